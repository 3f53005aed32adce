"""The ``intent`` command line: ``intent demo``, ``intent report`` and ``intent store prune``, and the subcommands other packages add
through the entry-point group ``intent.commands`` (:func:`_extensions`)."""

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
        if args.source is not None or args.out:
            # Either would be ignored: the shared budget's report is read from the store and printed only.
            given = " and ".join(x for x in (args.source and f"the source {args.source}", args.out and "--out") if x)
            raise UsageError(f"--store reports a shared budget from the store, printed only: drop {given}, or drop "
                             "--store and --key to report a guard log or run directory")
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


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str, flag: str) -> float:
    """``90d``, ``12h``, ``30m``, ``45s`` in seconds (a unit is required: a bare ``90`` is days to some, seconds to
    others, and pruning with the wrong one deletes history)."""
    import re

    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if match is None:
        raise UsageError(f"{flag} {text!r}: give a unit: 90d, 12h, 30m or 45s")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def _store_prune(args: argparse.Namespace) -> int:
    import datetime as dt
    import time

    from intent.report import open_existing_store
    from intent.stores import StoreArgumentError
    from intent.stores.sql import _without_password

    older = _duration(args.older_than, "--older-than")
    store = open_existing_store(args.store)
    try:
        deleted = store.prune(older, key=args.key)
    except StoreArgumentError as exc:  # (too short a cutoff: named by the flag the user typed)
        raise UsageError(f"--older-than {args.older_than}: {exc}") from None
    finally:
        store.close()
    before = dt.datetime.fromtimestamp(time.time() - older, dt.timezone.utc).isoformat(timespec="seconds")
    print(f"pruned {deleted} settled charges (committed, released or expired before {before}) from "
          f"{_without_password(args.store)}, " + (f"key {args.key}" if args.key else "every key")
          + "; the budgets' totals are unchanged")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="intent", description="Budget planning for LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a scripted agent with priced tools under the guard (simulated)")
    demo.add_argument("--budget", type=positive_float, default=50.0, help="the money budget (default 50)")
    demo.set_defaults(func=_demo)
    report = sub.add_parser("report", help="where the money went: spend by tool and model, refusals, top-ups")
    report.add_argument("source", nargs="?", help="a guard log (.jsonl) or a run directory (searched for *.jsonl)")
    report.add_argument("--store", default=None,
                        help="a shared budget store: sqlite:///PATH or postgresql://... (with --key)")
    report.add_argument("--key", default=None, help="the shared budget's key, e.g. customer-42/2026-11-23")
    report.add_argument("--out", default=None, help="also write budget_report.{md,json,png} to this directory")
    report.set_defaults(func=_report)
    store = sub.add_parser("store", help="look after a shared budget store (prune its settled history)")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    prune = store_sub.add_parser(
        "prune", help="delete settled charges (committed, released, expired) older than --older-than; never a hold",
        description="Delete the settled charges (committed, released, expired) last changed before --older-than ago. "
                    "Held reservations are kept, and each budget's spent and reserved totals are unchanged; a late "
                    "commit of a pruned charge is refused, so keep far longer than any worker may stay away.")
    prune.add_argument("--store", required=True, help="sqlite:///PATH or postgresql://... (its role needs DELETE)")
    prune.add_argument("--older-than", required=True, help="how old a settled charge must be: 90d, 12h, 30m, 45s")
    prune.add_argument("--key", default=None, help="only this budget key (default: every key)")
    prune.set_defaults(func=_store_prune)
    registrars = _extensions()
    for register in registrars:
        register(sub)
    parser.intent_plugins = len(registrars)  # type: ignore[attr-defined]  # read by main()
    return parser


COMMANDS_GROUP = "intent.commands"
_BUILT_IN = ("demo", "report", "store")


def _extensions() -> list[Callable[[Any], None]]:
    """The registrars of the subcommands other packages add (``bench``, ``train``, ``serve``, ...).

    A plugin is an entry point of the group ``intent.commands`` whose object is ``register(subparsers)``
    (this project's: ``[project.entry-points."intent.commands"]`` in pyproject.toml). ``intent`` names no
    plugin: the packages that add commands import ``intent``, never the other way round. They are read from
    the installed metadata, except that ``intent``'s own table is read from the pyproject.toml of the source
    tree this ``intent`` package is imported from, when there is one: that table describes the code that is
    running (``python -m intent.cli`` from a checkout, or an editable install whose metadata is older than
    the table). Registrars run in the order of their names. A plugin whose top-level package is not
    installed is skipped, as its commands are not there; any other import error propagates.
    """
    import importlib.metadata as md

    entries: dict[str, str] = {}
    source = _source_tree_commands()
    for ep in md.entry_points(group=COMMANDS_GROUP):
        dist = getattr(getattr(ep, "dist", None), "name", None)
        if source is not None and dist is not None and dist.lower() == "intent":
            continue  # stale or another checkout's metadata: the source tree's table below is the truth
        entries.setdefault(ep.name, ep.value)
    entries.update(source or {})
    registrars = []
    for name in sorted(entries):
        ep = md.EntryPoint(name=name, value=entries[name], group=COMMANDS_GROUP)
        try:
            registrars.append(ep.load())
        except ModuleNotFoundError as exc:
            module = ep.module
            if exc.name not in (module, module.split(".")[0]):
                raise
    return registrars


def _source_tree_commands() -> dict[str, str] | None:
    """``[project.entry-points."intent.commands"]`` of the pyproject.toml beside this ``intent`` package,
    when it is a source tree of the ``intent`` project; None otherwise (an installed wheel)."""
    from pathlib import Path

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.is_file():
        return None
    import tomllib

    with pyproject.open("rb") as f:
        project = tomllib.load(f).get("project", {})
    if project.get("name") != "intent":
        return None
    return dict(project.get("entry-points", {}).get(COMMANDS_GROUP, {}))


def _no_plugins_error(argv: Sequence[str]) -> str | None:
    """What to say when a command that is not built in is asked for and no plugin is registered at all."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is None or command in _BUILT_IN:
        return None
    return (f"intent: error: no command {command!r}: only {', '.join(_BUILT_IN)} are built in, and no other "
            f"command is registered (entry-point group {COMMANDS_GROUP!r}; bench, train, serve, ... are this "
            "project's). The installed metadata of intent predates that group: re-run `make install` (or pip "
            "install -e . in the source tree)")


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
    argv = sys.argv[1:] if argv is None else list(argv)
    if not getattr(parser, "intent_plugins", 0) and (message := _no_plugins_error(argv)):
        print(message, file=sys.stderr)
        return 2
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
