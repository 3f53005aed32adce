"""Where the guard's Python code spends its bytecodes: a per-function count, the same on any machine.

``python -m eval.profile_opcodes [--calls 20] [--top 25] [--path intent/]`` (``make profile-opcodes``)

Runs bench-guard's ``noop_presigned`` (a no-op middleware with the guard's hooks, presigned as the guard's
are) and ``guarded`` arms (:mod:`eval.bench_guard`: a scripted model and an
instant tool, simulated; AcceptAll) for one episode each after warm-up ones, with every Python bytecode
counted per function (``sys.settrace`` with opcode events, in every thread: LangGraph runs tool calls in a
pool). Prints, per tool call, the bytecodes the guarded arm runs beyond the no-op one, and the functions
under ``--path`` with the most bytecodes of their own.

A bytecode is not an instruction: C-level work (a dict copied, a dict compared) counts as one bytecode
whatever its size, so a change that moves work from Python loops into C can lower this count without
lowering ``make bench-instructions``' (which is the measure); this says where the Python code is.
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
from collections import Counter
from typing import Any

ARMS = ("noop_presigned", "guarded")
WARM_UP = 2


def count(arm: str, calls: int) -> tuple[Counter[str], Counter[str]]:
    """Bytecodes run by each function (its own, not its callees') and calls of each, over one episode."""
    from langchain_core.messages import HumanMessage

    from eval.bench_guard import build_agent

    own: Counter[str] = Counter()
    entered: Counter[str] = Counter()
    names: dict[Any, str] = {}

    def name_of(code: Any) -> str:
        name = names.get(code)
        if name is None:
            name = names[code] = f"{code.co_filename}:{code.co_firstlineno}:{code.co_qualname}"
        return name

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            entered[name_of(frame.f_code)] += 1
        elif event == "opcode":
            own[name_of(frame.f_code)] += 1
        return trace

    for _ in range(WARM_UP):
        build_agent(calls, arm).invoke({"messages": [HumanMessage("go")]})
    agent = build_agent(calls, arm)
    gc.collect()
    gc.disable()
    threading.settrace(trace)
    sys.settrace(trace)
    try:
        agent.invoke({"messages": [HumanMessage("go")]})
    finally:
        sys.settrace(None)
        threading.settrace(None)
        gc.enable()
    return own, entered


def profile(calls: int = 20) -> dict[str, Any]:
    """Per tool call: each arm's bytecodes, and each function's own bytecodes and calls in the guarded arm."""
    counted = {arm: count(arm, calls) for arm in ARMS}
    own, entered = counted["guarded"]
    return {
        "calls_per_episode": calls,
        "bytecodes_per_call": {arm: sum(c[0].values()) / calls for arm, c in counted.items()},
        "functions": {name: (n / calls, entered[name] / calls) for name, n in own.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="tool calls per episode")
    parser.add_argument("--top", type=int, default=25, help="how many functions to list")
    parser.add_argument("--path", default="intent/", help="list only functions whose file path contains this")
    args = parser.parse_args(argv)
    for name in ("calls", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    result = profile(args.calls)
    per_call = result["bytecodes_per_call"]
    print(f"Python bytecodes per tool call ({args.calls} calls, one episode; AcceptAll, scripted model: simulated)")
    for arm, n in per_call.items():
        print(f"  {arm:<12} {n:10.0f}")
    print(f"  guarded - noop_presigned {per_call['guarded'] - per_call['noop_presigned']:.0f}")
    shown = sorted(((n, c, name) for name, (n, c) in result["functions"].items() if args.path in name), reverse=True)
    print(f"Functions under {args.path!r} by their own bytecodes per tool call (calls per tool call):")
    for n, c, name in shown[: args.top]:
        print(f"  {n:8.0f} {c:6.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
