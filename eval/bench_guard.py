"""The guard's own cost per tool call: the same scripted agent with and without the guard.

``python -m eval.bench_guard [--calls 20] [--episodes 20] [--repeats 5] [--json PATH]``

Three arms run in this one process, interleaved, with the AcceptAll oracle, a scripted chat
model (simulated) and a tool that returns at once:

* ``plain``: ``create_agent`` with no middleware;
* ``noop_hooks``: a middleware with the same hooks as the guard that do nothing
  (``wrap_model_call``, a ``wrap_tool_call`` returning a ``Command``, ``after_agent``): the
  price of LangChain's middleware plumbing itself;
* ``guarded``: ``BudgetGuard(AcceptAll(), ...).middleware()``.

``guard_vs_unguarded_paired_median_ms`` is the headline (issue #11's measure, "guarded vs
unguarded in the same run"): the median, over episodes, of (guarded episode - the unguarded
episode of the same round; each round runs unguarded, no-op, guarded) per call: what a user
pays. ``guard_share_paired_median_ms`` is the same against the no-op middleware (run just
before the guarded one): the guard's code and state, without LangChain's per-hook plumbing.
``guard_own_ms_per_call`` is the same
difference between the arms' fastest repeats; ``added_ms_per_call`` = guarded - plain is what a
user pays in total. ``guard_hooks_in_graph_ms_per_call`` times the guard's hooks directly inside
the graph (the model and tool handlers they wrap excluded), and ``guard_code_only_ms_per_call``
times the guard's code with no graph at all (:class:`intent.testing.GuardDriver`: settle, gate,
metered run and charge, with a stand-in tool).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import threading
import time
import types
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langgraph.types import Command
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import StructuredTool

from intent import AcceptAll, BudgetGuard, Market, PricedTool
from intent.middleware import _presign
from intent.testing import scripted


def _script(calls: int) -> list[AIMessage]:
    msgs = [AIMessage("", tool_calls=[{"name": "echo", "args": {"x": i}, "id": f"c{i}", "type": "tool_call"}])
            for i in range(calls)]
    return [*msgs, AIMessage("done")]


def _echo() -> StructuredTool:
    return StructuredTool.from_function(lambda x: str(x), name="echo", description="returns its input")


class _TimedEcho(StructuredTool):
    """The echo tool of the timed arm: its own runs are timed, to take them out of the guard's."""

    def invoke(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return super().invoke(*args, **kwargs)
        finally:
            HOOKS.tool_seconds += time.perf_counter() - started


class _NoopHooks(AgentMiddleware):
    """The guard's hook shape (``gate_at="model_call"``, the default), doing nothing: isolates
    LangChain's middleware cost."""

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        return handler(request)

    def after_agent(self, state: Any, runtime: Any) -> None:
        return None

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        return Command(update={"messages": [handler(request)]})


class _PresignedNoopHooks(_NoopHooks):
    """:class:`_NoopHooks` with each ``wrap_*`` hook carrying its ``__signature__``, as the guard's do
    (``intent.middleware._presign``): LangChain's plumbing for the guard's shape, as the guard pays it."""


for _name in ("wrap_model_call", "wrap_tool_call"):  # copies of its own: _presign signs a class's own hooks
    _hook = _NoopHooks.__dict__[_name]
    setattr(_PresignedNoopHooks, _name, types.FunctionType(_hook.__code__, _hook.__globals__, _name,
                                                           _hook.__defaults__, _hook.__closure__))
_presign(_PresignedNoopHooks)


class _WrapModelOnly(AgentMiddleware):
    wrap_model_call = _PresignedNoopHooks.wrap_model_call


class _WrapToolOnly(AgentMiddleware):
    wrap_tool_call = _PresignedNoopHooks.wrap_tool_call


class _WrapToolMessageOnly(AgentMiddleware):
    """A presigned ``wrap_tool_call`` returning the tool's ``ToolMessage`` as is, not a ``Command``."""

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        return handler(request)


_presign(_WrapToolMessageOnly)


class _AfterAgentOnly(AgentMiddleware):
    def after_agent(self, state: Any, runtime: Any) -> None:
        return None


# LangChain's plumbing for the guard's shape, one hook at a time (each a no-op, the wrappers presigned):
# `python -m eval.bench_instructions --arms plain,` + these.
PLUMBING_ARMS = ("wrap_model_only", "wrap_tool_only", "wrap_tool_message_only", "after_agent_only")


class _HookClock:
    """Time spent in the guard's code inside the graph: its hooks, minus the model and tool
    handlers they wrap, plus its metered run of the tool (inside the tool handler), minus the
    tool's own run. A direct reading, not a difference of two runs."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_part: dict[str, float] = {}  # the same time, by hook (and "metered_run")
        self.tool_seconds = 0.0  # the timed arm's tool's own runs (_TimedEcho)
        self.active = False  # only the timed arm's episodes are counted

    def add(self, part: str, seconds: float) -> None:
        self.seconds += seconds
        self.by_part[part] = self.by_part.get(part, 0.0) + seconds

    def wrap(self, middleware: Any) -> Any:
        clock = self

        def timed(fn: Any) -> Any:
            @functools.wraps(fn)
            def hook(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    clock.add(fn.__name__, time.perf_counter() - started)
            return hook

        def timed_wrapper(fn: Any) -> Any:
            @functools.wraps(fn)
            def hook(request: Any, handler: Any) -> Any:
                inner = 0.0

                def timed_handler(req: Any) -> Any:
                    nonlocal inner
                    started = time.perf_counter()
                    try:
                        return handler(req)
                    finally:
                        inner += time.perf_counter() - started

                started = time.perf_counter()
                try:
                    return fn(request, timed_handler)
                finally:
                    clock.add(fn.__name__, time.perf_counter() - started - inner)
            return hook

        for name in ("before_model", "after_model", "after_agent"):
            object.__setattr__(middleware, name, timed(getattr(middleware, name)))
        for name in ("wrap_model_call", "wrap_tool_call"):
            object.__setattr__(middleware, name, timed_wrapper(getattr(middleware, name)))
        return middleware

    def install(self) -> None:
        """Count the guard's metered run (reserve, charge) that happens inside the tool handler: the general
        run's (``CallRun.execute``) and the lean one's (``LeanRun.execute``, :mod:`intent.lean_tool`), each run
        once (a lean run handing a run to the general code is counted as one)."""
        from intent.lean_tool import LeanRun
        from intent.metering import CallRun

        clock, inside = self, threading.local()

        def timed(execute: Any) -> Any:
            def timed_execute(run: Any, tool: Any, tool_input: Any, config: Any, kwargs: dict[str, Any]) -> Any:
                if not clock.active:  # (first, alone: the untimed arms' runs pay what they paid before)
                    return execute(run, tool, tool_input, config, kwargs)
                if getattr(inside, "run", False):
                    return execute(run, tool, tool_input, config, kwargs)
                tool_before = clock.tool_seconds
                inside.run = True
                started = time.perf_counter()
                try:
                    return execute(run, tool, tool_input, config, kwargs)
                finally:
                    inside.run = False
                    clock.add("metered_run", time.perf_counter() - started - (clock.tool_seconds - tool_before))
            return timed_execute

        CallRun.execute = timed(CallRun.execute)  # type: ignore[method-assign]
        LeanRun.execute = timed(LeanRun.execute)  # type: ignore[method-assign]


HOOKS = _HookClock()


def build_agent(calls: int, arm: str) -> Any:
    """The agent of one episode of ``arm`` (shared with eval.bench_instructions)."""
    market = Market([PricedTool("echo", 1.0)])
    middleware: list[Any] = {
        "plain": [],
        "noop_hooks": [_NoopHooks()],
        "noop_presigned": [_PresignedNoopHooks()],
        "wrap_model_only": [_WrapModelOnly()],
        "wrap_tool_only": [_WrapToolOnly()],
        "wrap_tool_message_only": [_WrapToolMessageOnly()],
        "after_agent_only": [_AfterAgentOnly()],
        "guarded": [BudgetGuard(AcceptAll(), market, float(calls)).middleware()],
        "guarded_timed": [HOOKS.wrap(BudgetGuard(AcceptAll(), market, float(calls)).middleware())],
    }[arm]
    # One tool object for every episode, as an application defines its tools once.
    tool = _TIMED_ECHO if arm == "guarded_timed" else _ECHO
    agent = create_agent(scripted(_script(calls)), [tool], middleware=middleware)
    return agent.with_config(recursion_limit=4 * calls + 10)


def _episode(calls: int, arm: str) -> float:
    agent = build_agent(calls, arm)
    # A collection in the middle of one arm's episode is noise the other arm does not pay.
    gc.collect()
    gc.disable()
    try:
        started = time.perf_counter()
        agent.invoke({"messages": [HumanMessage("go")]})
        return time.perf_counter() - started
    finally:
        gc.enable()


def _guard_only(calls: int) -> float:
    """Gate + metered run + charge for ``calls`` calls, driving the guard directly (no graph)."""
    from intent.testing import GuardDriver

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("echo", 1.0)]), float(calls))
    driver = GuardDriver(guard)  # a stand-in tool that answers at once: only the guard is timed
    started = time.perf_counter()
    for i in range(calls):
        driver.step(AIMessage("", tool_calls=[{"name": "echo", "args": {"x": i}, "id": f"c{i}", "type": "tool_call"}]))
    return time.perf_counter() - started


_ECHO = _echo()
_TIMED_ECHO = _TimedEcho(name="echo", description="returns its input", func=lambda x: str(x),
                         args_schema=_ECHO.args_schema)


ARMS = ("plain", "noop_hooks", "guarded")


def run(calls: int = 20, episodes: int = 20, repeats: int = 5) -> dict[str, float]:
    from intent.progress import progress

    HOOKS.install()
    for arm in (*ARMS, "guarded_timed"):
        _episode(5, arm)  # warm up imports and caches
    HOOKS.by_part = {}  # the warm-up's hooks are not counted
    times: dict[str, list[float]] = {arm: [] for arm in (*ARMS, "direct")}
    # Episode by episode, the arms interleaved: each guarded episode is paired with the no-op
    # episode run just before it, and the median of those differences is the guard's share
    # (drift and a busy neighbour hit both halves of a pair alike).
    pairs: list[float] = []
    pairs_plain: list[float] = []
    hook_seconds, hook_calls = 0.0, 0
    bar = progress(repeats * episodes, "bench-guard episodes (4 arms each)")
    for _ in range(repeats):
        totals = dict.fromkeys(times, 0.0)
        for _ in range(episodes):
            per = {arm: _episode(calls, arm) for arm in ARMS}
            for arm, seconds in per.items():
                totals[arm] += seconds
            pairs.append((per["guarded"] - per["noop_hooks"]) / calls)
            pairs_plain.append((per["guarded"] - per["plain"]) / calls)
            totals["direct"] += _guard_only(calls)
            HOOKS.seconds, HOOKS.active = 0.0, True
            try:
                _episode(calls, "guarded_timed")
            finally:
                HOOKS.active = False
            hook_seconds, hook_calls = hook_seconds + HOOKS.seconds, hook_calls + calls
            bar.update()
        for arm, seconds in totals.items():
            times[arm].append(seconds)
    bar.close()
    n = calls * episodes
    # The fastest repeat of each arm: the same work every time, so anything slower is noise
    # from this shared 2-core machine (thread start-up, other processes).
    ms = {arm: 1000 * min(v) / n for arm, v in times.items()}
    pairs.sort()
    pairs_plain.sort()
    return {
        "calls_per_episode": calls,
        "episodes": episodes,
        "repeats": repeats,
        "plain_ms_per_call": ms["plain"],
        "noop_hooks_ms_per_call": ms["noop_hooks"],
        "guarded_ms_per_call": ms["guarded"],
        "guard_vs_unguarded_paired_median_ms": 1000 * pairs_plain[len(pairs_plain) // 2],
        "added_ms_per_call": ms["guarded"] - ms["plain"],
        "guard_own_ms_per_call": ms["guarded"] - ms["noop_hooks"],
        "guard_share_paired_median_ms": 1000 * pairs[len(pairs) // 2],
        "guard_hooks_in_graph_ms_per_call": 1000 * hook_seconds / hook_calls,
        **{f"in_graph_{part}_ms": 1000 * seconds / hook_calls for part, seconds in sorted(HOOKS.by_part.items())},
        "guard_code_only_ms_per_call": ms["direct"],
        "ratio_guarded_to_plain": ms["guarded"] / ms["plain"],
        "ratio_guarded_to_noop_hooks": ms["guarded"] / ms["noop_hooks"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="tool calls per episode (a B=50 task has ~5-10)")
    parser.add_argument("--episodes", type=int, default=20, help="episodes per arm and repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    for name in ("calls", "episodes", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    result = run(args.calls, args.episodes, args.repeats)
    show_figures("Guard overhead per tool call (AcceptAll oracle, scripted model: simulated; same run, fastest of "
                 "repeats)", result, args.json)
    return 0


def show_figures(title: str, result: dict[str, Any], json_path: str | None) -> None:
    """Print a bench's figures under ``title``, one per line, and write them to ``json_path`` if given."""
    print(title)
    width = max(28, *(len(k) for k in result))
    for k, v in result.items():
        print(f"  {k:{width}s} {v:.4f}" if isinstance(v, float) else f"  {k:{width}s} {v}")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    raise SystemExit(main())
