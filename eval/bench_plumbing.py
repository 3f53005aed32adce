"""What LangChain's middleware plumbing costs per tool call, before any guard code runs.

``python -m eval.bench_plumbing [--calls 20] [--episodes 10] [--repeats 6]``

The same scripted agent (simulated model, an instant tool) as ``make bench-guard``, with one
middleware whose hooks do nothing, in one run, interleaved; the median per-call time of each arm
minus the arm with no middleware. It bounds what any guard built from these hooks must pay:

* one no-op hook of each kind (``before_model``, ``after_model``, ``wrap_model_call``,
  ``wrap_tool_call`` returning a ``Command``): what each hook adds to every turn;
* the guard's own shape, three hooks (``wrap_model_call``, ``wrap_tool_call``, ``after_agent``), then
  the same with the guard's state schema (the ledger channel), with a state update returned from
  the model call (``ExtendedModelResponse``, as the gate does), and with a ledger write from each
  tool step (as the metered run does): what carrying the guard's state costs;
* the five-hook shape the guard had before its gate moved into the model call;
* a floor: :class:`MinimalGate`, the least a gate with the guard's state contract can do (price
  each call, check it fits, reserve it and write the decision to graph state from the model call;
  at the tool step read the decision from state, validate the arguments, run, commit and write
  the charge), then ``BudgetGuard`` itself;
* the same three hook shapes, the floor and the guard once more with LangChain's tracing of the
  middleware's ``wrap_*`` hooks taken out (``create_agent`` wraps each such hook in a LangSmith
  ``traceable`` span, which runs on every call even with tracing off, and a middleware cannot opt
  out): what that tracing costs. A measurement only: the library never patches LangChain.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import uuid
from collections.abc import Iterator
import statistics
import time
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain.agents.middleware.types import ExtendedModelResponse
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.types import Command

from intent import AcceptAll, BudgetGuard, Market, PricedTool
from intent.middleware import BudgetState
from intent.progress import progress
from intent.testing import scripted

_ids = itertools.count()


def _ledger_update(status: str) -> dict[str, Any]:
    cid = f"c{next(_ids)}"
    return {"episode_id": "e", "budget": 1e9, "entries": {cid: {
        "call_id": cid, "tool": "echo", "amount": 1.0, "status": status, "seq": 0, "market_version": 0,
        "tool_call_id": cid, "execution": 0, "overrun": 0.0, "kind": "tool"}}}


def _arm(hooks: tuple[str, ...], *, schema: bool = False, model_update: bool = False,
         tool_update: bool = False) -> type[AgentMiddleware]:
    body: dict[str, Any] = {}
    if "before_model" in hooks:
        body["before_model"] = lambda self, state, runtime: None
    if "after_model" in hooks:
        body["after_model"] = lambda self, state, runtime: None
    if "after_agent" in hooks:
        body["after_agent"] = lambda self, state, runtime: None
    if "wrap_model_call" in hooks:
        def wrap_model_call(self: Any, request: Any, handler: Any) -> Any:
            response = handler(request)
            if model_update:
                return ExtendedModelResponse(model_response=response,
                                             command=Command(update={"intent_ledger": _ledger_update("reserved")}))
            return response
        body["wrap_model_call"] = wrap_model_call
    if "wrap_tool_call" in hooks:
        def wrap_tool_call(self: Any, request: Any, handler: Any) -> Any:
            update: dict[str, Any] = {"messages": [handler(request)]}
            if tool_update:
                update["intent_ledger"] = _ledger_update("committed")
            return Command(update=update)
        body["wrap_tool_call"] = wrap_tool_call
    if schema:
        body["state_schema"] = BudgetState
    return type(f"Noop_{'_'.join(hooks)}_{int(schema)}{int(model_update)}{int(tool_update)}", (AgentMiddleware,),
                body)


class MinimalGate(AgentMiddleware):
    """A floor, not a guard: the least work a gate with ``BudgetGuard``'s state contract does.

    The model call prices each proposed call, checks that it fits, reserves it and returns the
    decisions and reservations as a state update; the tool step reads its decision from graph
    state, validates the arguments against the tool's schema, runs the tool once, commits the
    charge and writes it to state. None of the guard's other duties (retries metered per run,
    calls answered by other middleware, duplicate ids, re-pricing, edits re-gated, bills, logs,
    oracles, shared budgets): what any guard with these hooks and this state must pay at least.
    """

    state_schema = BudgetState

    def __init__(self) -> None:
        super().__init__()
        self.prices, self.budget, self.held = {"echo": 1.0}, 1e9, 0.0

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        response = handler(request)
        ai = response.result[-1]
        if not isinstance(ai, AIMessage) or not ai.tool_calls:
            return response
        if not ai.id:
            ai.id = f"lc_{uuid.uuid4()}"
        entries: dict[str, Any] = {}
        decisions: dict[str, Any] = {}
        for call in ai.tool_calls:
            key, price = f"{ai.id}:{call['id']}", self.prices[call["name"]]
            accept = self.held + price <= self.budget
            if accept:
                self.held += price
                entries[key] = _entry(key, call["id"], price, "reserved")
            decisions[key] = {"accept": accept, "tool": call["name"], "args": call["args"], "price": price}
        update = {"intent_ledger": {"episode_id": "e", "budget": self.budget, "entries": entries,
                                    "decisions": decisions}}
        return ExtendedModelResponse(model_response=response, command=Command(update=update))

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        call, state = request.tool_call, request.state
        ai = next(m for m in reversed(state["messages"])
                  if isinstance(m, AIMessage) and any(c["id"] == call["id"] for c in m.tool_calls))
        key = f"{ai.id}:{call['id']}"
        decision = state["intent_ledger"]["decisions"][key]
        if not decision["accept"]:
            return ToolMessage("refused", tool_call_id=call["id"], status="error")
        request.tool.tool_call_schema.model_validate(call["args"])
        message = handler(request)
        return Command(update={"messages": [message], "intent_ledger": {
            "entries": {key: _entry(key, call["id"], decision["price"], "committed", execution=1)}}})


def _entry(key: str, tool_call_id: str, amount: float, status: str, execution: int = 0) -> dict[str, Any]:
    return {"call_id": key, "tool": "echo", "amount": amount, "status": status, "seq": 0, "market_version": 0,
            "tool_call_id": tool_call_id, "execution": execution, "overrun": 0.0, "kind": "tool"}


def _guard() -> AgentMiddleware:
    return BudgetGuard(AcceptAll(), Market([PricedTool("echo", 1.0)]), 1e9).middleware()


@contextlib.contextmanager
def _without_hook_tracing() -> Iterator[None]:
    """``create_agent`` inside this block does not wrap the middleware's ``wrap_*`` hooks in
    LangSmith spans (it reads ``traceable`` when the agent is built). For measuring only."""
    import langchain.agents.factory as factory

    traceable = factory.traceable
    factory.traceable = lambda *args, **kwargs: (lambda fn: fn)
    try:
        yield
    finally:
        factory.traceable = traceable


GUARD_HOOKS = ("wrap_model_call", "wrap_tool_call", "after_agent")
ARMS: dict[str, Any] = {
    "no middleware": None,
    "before_model only": _arm(("before_model",)),
    "after_model only": _arm(("after_model",)),
    "wrap_model_call only": _arm(("wrap_model_call",)),
    "wrap_tool_call only (Command)": _arm(("wrap_tool_call",)),
    "guard's 3 hooks": _arm(GUARD_HOOKS),
    "+ ledger channel in the schema": _arm(GUARD_HOOKS, schema=True),
    "+ state update from the model call": _arm(GUARD_HOOKS, schema=True, model_update=True),
    "+ ledger write from each tool step": _arm(GUARD_HOOKS, schema=True, model_update=True, tool_update=True),
    "five hooks (the gate in after_model)": _arm(("before_model", "after_model", *GUARD_HOOKS)),
    "minimal gate (a floor)": MinimalGate,
    "BudgetGuard": _guard,
}
# Arms built with LangChain's hook tracing taken out (see _without_hook_tracing).
UNTRACED = {
    "untraced: guard's 3 hooks": ARMS["guard's 3 hooks"],
    "untraced: + ledger write from each tool step": ARMS["+ ledger write from each tool step"],
    "untraced: minimal gate (a floor)": MinimalGate,
    "untraced: BudgetGuard": _guard,
}
ARMS.update(UNTRACED)
_ECHO = StructuredTool.from_function(lambda x: str(x), name="echo", description="returns its input")


def _episode(arm: str, calls: int) -> float:
    script = [AIMessage("", tool_calls=[{"name": "echo", "args": {"x": i}, "id": f"c{i}", "type": "tool_call"}])
              for i in range(calls)]
    middleware = ARMS[arm]
    with _without_hook_tracing() if arm in UNTRACED else contextlib.nullcontext():
        agent = create_agent(scripted([*script, AIMessage("done")]), [_ECHO],
                             middleware=[] if middleware is None else [middleware()])
    agent = agent.with_config(recursion_limit=4 * calls + 10)
    gc.collect()
    gc.disable()  # a collection inside one arm's episode is noise the other arms do not pay
    try:
        started = time.perf_counter()
        agent.invoke({"messages": [HumanMessage("go")]})
        return (time.perf_counter() - started) / calls * 1000
    finally:
        gc.enable()


def run(calls: int = 20, episodes: int = 10, repeats: int = 6) -> dict[str, float]:
    """Median ms per tool call of each arm, minus the arm with no middleware."""
    for arm in ARMS:
        _episode(arm, 5)  # warm up
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    bar = progress(repeats * episodes, "bench-plumbing episodes (all arms each)")
    for _ in range(repeats * episodes):
        for arm in ARMS:
            times[arm].append(_episode(arm, calls))
        bar.update()
    bar.close()
    base = statistics.median(times["no middleware"])
    return {arm: statistics.median(v) - base for arm, v in times.items()} | {"no middleware (ms per call)": base}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="tool calls per episode (>= 1)")
    parser.add_argument("--episodes", type=int, default=10, help="episodes per repeat (>= 1)")
    parser.add_argument("--repeats", type=int, default=6, help="repeats (>= 1)")
    args = parser.parse_args(argv)
    for name in ("calls", "episodes", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    result = run(args.calls, args.episodes, args.repeats)
    print("LangChain middleware plumbing, ms per tool call over create_agent with no middleware "
          "(no-op hooks, scripted model: simulated; median of interleaved episodes)")
    for arm, ms in result.items():
        print(f"  {arm:40s} {ms:+.3f}" if arm != "no middleware (ms per call)" else f"  {arm:40s} {ms:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
