"""The ``intent`` command line: ``intent demo`` (and the subcommands added by later modules)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from intent.errors import IntentError, UsageError


def _demo(args: argparse.Namespace) -> int:
    from intent.demo import run_demo

    run_demo(budget=args.budget)
    return 0


def _report(args: argparse.Namespace) -> int:
    from intent.report import budget_report, shared_budget_report

    if args.store or args.key:
        if not (args.store and args.key):
            raise UsageError("--store and --key go together: intent report --store sqlite:///budgets.db --key K")
        print(shared_budget_report(args.store, args.key), end="")
        return 0
    if args.source is None:
        raise UsageError("give a guard log or run directory, or --store URL --key K for a shared budget")
    report = budget_report(args.source)
    written = report.write(args.out) if args.out else []  # before printing: a bad --out fails with no output
    print(report.to_markdown(), end="")
    for path in written:
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="intent", description="Budget planning for LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a scripted agent with priced tools under the guard (simulated)")
    demo.add_argument("--budget", type=float, default=50.0, help="the money budget (default 50)")
    demo.set_defaults(func=_demo)
    report = sub.add_parser("report", help="where the money went: spend by tool and model, refusals, top-ups")
    report.add_argument("source", nargs="?", help="a guard log (.jsonl) or a run directory (searched for *.jsonl)")
    report.add_argument("--store", default=None,
                        help="a shared budget store: sqlite:///PATH or postgresql://... (with --key)")
    report.add_argument("--key", default=None, help="the shared budget's key, e.g. customer-42/2026-11-23")
    report.add_argument("--out", default=None, help="also write budget_report.{md,json,png} to this directory")
    report.set_defaults(func=_report)
    for register in _extensions():
        register(sub)
    return parser


def _extensions():  # noqa: ANN202 - subcommands that live in other packages register here
    import importlib

    registrars = []
    for module in ("eval.cli", "training.cli"):  # bench; train and serve
        try:
            registrars.append(importlib.import_module(module).register)
        except ModuleNotFoundError as exc:
            if exc.name not in (module, module.split(".")[0]):
                raise
    return registrars


def _positive(convert: Callable[[str], Any], noun: str, bound: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = convert.__name__  # argparse names the type in its messages
    return parse


# argparse types: a count of epochs, steps, processes... (>= 1), and a finite number > 0 (a learning rate).
positive_int = _positive(int, "an integer", "an integer >= 1")
positive_float = _positive(float, "a number", "a number > 0")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (IntentError, FileNotFoundError) as exc:
        # Raised on purpose (a UsageError names the input and the fix): one line. Anything else, a plain
        # ValueError included, is a bug and propagates with its traceback.
        print(f"intent {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"intent {args.command}: interrupted; what finished is saved (benchmarks: run the same command to "
              "resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
