"""The guard's cost per tool call in machine instructions: a figure a busy machine cannot move.

``python -m eval.bench_instructions [--calls 20] [--episodes 3] [--arms plain,noop_hooks,noop_presigned,guarded] [--json PATH]`` (``make bench-instructions``;
needs valgrind: ``apt-get install valgrind``)

``make bench-guard`` measures milliseconds, which drift by tens of percent between runs on a shared
machine. This runs the same arms (:mod:`eval.bench_guard`: ``create_agent`` with no middleware, a
no-op middleware with the guard's hooks, the same with its hooks presigned as the guard's are,
``BudgetGuard(AcceptAll(), ...).middleware()``; a scripted
model and an instant tool, simulated) under callgrind, each in a process of its own, and counts the
instructions executed inside ``agent.invoke`` only (after warm-up episodes, with the garbage collector
paused, as in bench-guard). The count is the same on an idle or a loaded machine, so two commits can be
compared by it; it does not say how long an instruction takes (cache misses, the CPU).

``--arms plain,wrap_model_only,wrap_tool_only,wrap_tool_message_only,after_agent_only`` splits LangChain's
plumbing hook by hook (:data:`eval.bench_guard.PLUMBING_ARMS`: one no-op hook each, the wrappers presigned;
``wrap_tool_message_only`` returns the tool's ToolMessage where the guard's shape returns a Command).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eval.bench_guard import PLUMBING_ARMS

ARMS = ("plain", "noop_hooks", "noop_presigned", "guarded")
WARM_UP = 2  # episodes per arm before counting: imports, caches, LangGraph's compiled graph


def _child(arm: str, calls: int, episodes: int) -> None:
    """Run in valgrind: ``episodes`` counted episodes of ``arm``, instrumentation on only inside invoke."""
    from langchain_core.messages import HumanMessage

    from eval.bench_guard import build_agent

    pid = str(os.getpid())

    def control(*args: str) -> None:
        subprocess.run(["callgrind_control", *args, pid], check=True, capture_output=True)

    for _ in range(WARM_UP):
        build_agent(calls, arm).invoke({"messages": [HumanMessage("go")]})
    control("-z")
    for _ in range(episodes):
        graph = build_agent(calls, arm)
        gc.collect()
        gc.disable()
        control("-i", "on")
        graph.invoke({"messages": [HumanMessage("go")]})
        control("-i", "off")
        gc.enable()
    control("-d", "counted")


def _counted(out_dir: Path) -> int:
    """The instructions of the dump named ``counted`` (the files callgrind wrote in ``out_dir``)."""
    for path in out_dir.iterdir():
        text = path.read_text(errors="replace")
        if re.search(r"^desc: Trigger: .*counted", text, re.M):
            match = re.search(r"^totals: (\d+)", text, re.M)
            if match:
                return int(match.group(1))
    raise RuntimeError(f"callgrind wrote no dump named 'counted' in {out_dir}")


def run(calls: int = 20, episodes: int = 3, arms: tuple[str, ...] = ARMS) -> dict[str, float]:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench-instructions needs valgrind (callgrind): apt-get install valgrind")
    root = Path(__file__).resolve().parents[1]
    per_call: dict[str, float] = {}
    started = time.monotonic()
    for i, arm in enumerate(arms):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/cg.%p",
                   sys.executable, "-m", "eval.bench_instructions", "--child", arm,
                   "--calls", str(calls), "--episodes", str(episodes)]
            print(f"bench-instructions arm {i + 1}/{len(arms)} ({arm}) under valgrind, "
                  f"{time.monotonic() - started:.0f} s elapsed", flush=True)
            # PYTHONHASHSEED: the same string hashes, so the same dict probes, in every run.
            done = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONHASHSEED": "0"},
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"the {arm} arm failed under valgrind:\n{done.stderr[-3000:]}")
            per_call[arm] = _counted(Path(tmp)) / (episodes * calls) / 1e6
    if set(arms) != set(ARMS):  # some arms only: their counts, no differences
        return {"calls_per_episode": calls, "episodes": episodes,
                **{f"{arm}_minstr_per_call": per_call[arm] for arm in arms}}
    plain, noop, signed, guarded = (per_call[a] for a in ARMS)
    return {
        "calls_per_episode": calls,
        "episodes": episodes,
        "plain_minstr_per_call": plain,
        "noop_hooks_minstr_per_call": noop,
        "noop_presigned_minstr_per_call": signed,
        "guarded_minstr_per_call": guarded,
        "added_minstr_per_call": guarded - plain,
        "noop_hooks_added_minstr_per_call": noop - plain,
        "guard_over_noop_minstr_per_call": guarded - noop,
        # LangChain's plumbing for the guard's shape as the guard pays it (its hooks presigned), and the rest:
        "noop_presigned_added_minstr_per_call": signed - plain,
        "guard_over_presigned_noop_minstr_per_call": guarded - signed,
        "ratio_guarded_to_plain": guarded / plain,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="tool calls per episode")
    parser.add_argument("--episodes", type=int, default=3, help="counted episodes per arm")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma-separated arms to count (default: all three, {','.join(ARMS)})")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--child", choices=(*ARMS, *PLUMBING_ARMS), help=argparse.SUPPRESS)  # the process valgrind runs
    args = parser.parse_args(argv)
    for name in ("calls", "episodes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    unknown = [a for a in arms if a not in ARMS and a not in PLUMBING_ARMS]
    if unknown or not arms:
        parser.error(f"--arms: unknown arm(s) {unknown or args.arms!r}; choose from {', '.join((*ARMS, *PLUMBING_ARMS))}")
    if args.child:
        _child(args.child, args.calls, args.episodes)
        return 0
    from eval.bench_guard import show_figures

    show_figures("Instructions per tool call, millions (AcceptAll oracle, scripted model: simulated; callgrind, "
                 "inside agent.invoke only)", run(args.calls, args.episodes, arms), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
