"""The budget report a person reads: where the money went, per episode and in total.

``budget_report(source)`` reads the guard's JSONL logs (a file, a run directory searched for
``*.jsonl``, or records already in memory) with :func:`intent.logs.read_log`, and returns a
:class:`BudgetReport`: spend by tool and by model (the oracle's and sub-agents' spend as their
own rows), runs and tokens, refusals by reason with what they would have cost, top-ups with
who approved them, and what is left. ``to_markdown()`` gives the tables, ``to_dict()`` the
same as JSON, ``plot(path)`` a PNG, ``write(out_dir)`` all three files.
``intent report RUN_DIR_OR_LOG [--out DIR]`` is the command line.

An episode is a task id within one directory: the logs of different run directories under the one
given (a study's sweeps) are kept apart even where their episode ids repeat (labelled with the
directory then), while one directory's logs of the same episode merge.

The numbers are sums of the log's own fields, never recomputed from prices: a record's
``charged`` is what that record charged (Σ over an episode == its spend), ``budget`` /
``remaining`` are the ledger after it, so the last record says the final budget (top-ups
included) and what is left.

Each dollar is counted once. A sub-agent's episode spends a carve of its parent's budget,
logged in the parent as one ``kind="sub_agent"`` record (``tool="sub-agent:<episode>"``), so
the totals (budget, spent, left, top-ups) add up top-level episodes only, while the tool /
model / oracle rows add up every episode's own runs: with the children's logs included,
tool + model + oracle == spent, and the sub_agent rows say how much of it sub-agents spent.
A child's top-up is not new money either: it grows the carve out of what the parent has left.

The currency is not in the logs, so amounts carry no symbol.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from intent.errors import UsageError
from intent.logs import LogFormatError, StepRecord, read_log

__all__ = ["BudgetReport", "EpisodeBudget", "budget_report"]

KINDS = ("tool", "model", "oracle", "sub_agent")
_COLORS = dict(zip(KINDS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))  # one colour per kind, every report
MAX_PLOTTED_EPISODES = 40
MAX_PLOTTED_ITEMS = 20
_TOKEN_KEYS = ("input", "output", "cached", "cache_write")  # intent.pricing.tokens_of
ORACLE_DATA = "oracle_data"  # a benchmark run's directory of the oracle models' training logs
_NOISE = 1e-12  # float sums of money leave residues like -1e-17 where the ledger holds 0


def _money(x: float) -> str:
    """Up to 6 significant digits and never scientific notation: people read these numbers."""
    if not math.isfinite(x):
        return str(x)
    if abs(x) < _NOISE:
        return "0"
    return format(Decimal(f"{x:.6g}"), "f")


def _cell(text: Any) -> str:
    """A markdown table cell: free text (reasons, names) must not break the table."""
    return str(text).replace("|", "\\|").replace("\r", " ").replace("\n", " ") or "-"


def _new_item() -> dict[str, float]:
    return {"spent": 0.0, "runs": 0, "failed": 0, **{k: 0 for k in _TOKEN_KEYS}}


def _merge(tables: Iterable[dict[Any, dict[str, float]]]) -> dict[Any, dict[str, float]]:
    """Add up rows with the same key, column by column (per-episode tables into the total)."""
    out: dict[Any, dict[str, float]] = {}
    for table in tables:
        for key, row in table.items():
            into = out.setdefault(key, dict.fromkeys(row, 0))
            for col, value in row.items():
                into[col] += value
    return out


@dataclass
class EpisodeBudget:
    """One episode's money, from its records in log order."""

    episode: str
    budget: float = 0.0  # the last record's: the final budget, top-ups included
    spent: float = 0.0  # Σ charged
    left: float = 0.0  # the last record's remaining
    overrun: float = 0.0  # billed above the reservations
    # (kind, name) -> spent, runs (charged executions), failed, input/output/cached/cache-write tokens
    by_item: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    # reason -> count, price (what the refused calls would have cost, where the price was known)
    refusals: dict[str, dict[str, float]] = field(default_factory=dict)
    top_ups: list[dict[str, Any]] = field(default_factory=list)  # episode, amount, approved_by, reason
    parent: str = ""  # set for a sub-agent's episode: its spend is already its parent's sub_agent charge

    def add(self, r: StepRecord) -> None:
        self.budget, self.left = r.budget, r.remaining
        self.spent += r.charged
        self.overrun += r.overrun
        if r.decision == "top_up":
            self.top_ups.append({"episode": self.episode, "amount": r.price or 0.0, "approved_by": r.approved_by,
                                 "reason": r.reason})
        elif r.decision in ("reject", "invalid"):
            row = self.refusals.setdefault(r.reason or r.decision, {"count": 0, "price": 0.0})
            row["count"] += 1
            row["price"] += r.price or 0.0
        elif r.charged or r.execution > 0 or r.status == "error":
            # a run (schema 1 had no execution field, hence charged), or a call that failed unbilled
            item = self.by_item.setdefault((r.kind, r.tool or "?"), _new_item())
            item["spent"] += r.charged
            item["runs"] += int(bool(r.charged or r.execution > 0))
            item["failed"] += int(r.status == "error")
            for key in _TOKEN_KEYS:
                item[key] += int((r.tokens or {}).get(key, 0))

    @property
    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (kind, _), row in self.by_item.items():
            out[kind] = out.get(kind, 0.0) + row["spent"]
        return out

    @property
    def topped_up(self) -> float:
        return sum(t["amount"] for t in self.top_ups)

    @property
    def refused(self) -> int:
        return int(sum(row["count"] for row in self.refusals.values()))

    @property
    def over_budget(self) -> float:
        """What the episode spent above its budget: only a guard with ``enforce=False`` lets that happen (Raw,
        Prompt), or a bill above its reservation (``overrun``)."""
        over = self.spent - self.budget
        return over if over > _NOISE * max(1.0, self.budget) else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"episode": self.episode, "parent": self.parent, "budget": self.budget, "spent": self.spent,
                "left": self.left, "overrun": self.overrun, "over_budget": self.over_budget,
                "top_ups": self.topped_up, "refused": self.refused,
                "spent_by_kind": self.by_kind, "by_item": _item_rows(self.by_item),
                "refusals": _refusal_rows(self.refusals), "top_up_list": self.top_ups}


def _item_rows(by_item: dict[tuple[str, str], dict[str, float]]) -> list[dict[str, Any]]:
    return [{"kind": k, "name": n, **row} for (k, n), row in sorted(by_item.items())]


def _refusal_rows(refusals: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    return [{"reason": r, **row} for r, row in sorted(refusals.items())]


@dataclass
class BudgetReport:
    """Spend by tool / model, refusals, top-ups and what is left, per episode and in total."""

    episodes: list[EpisodeBudget]
    sources: list[str] = field(default_factory=list)  # the logs read
    skipped: list[str] = field(default_factory=list)  # *.jsonl files in the run that are not guard logs

    # Totals. Money in and out (budget, spent, left, top-ups) is the top-level episodes'; the runs,
    # refusals and overruns are every episode's own (see the module docstring).
    @property
    def top_level(self) -> list[EpisodeBudget]:
        return [e for e in self.episodes if not e.parent]

    @property
    def budget(self) -> float:
        return sum(e.budget for e in self.top_level)

    @property
    def spent(self) -> float:
        return sum(e.spent for e in self.top_level)

    @property
    def left(self) -> float:
        return sum(e.left for e in self.top_level)

    @property
    def topped_up(self) -> float:
        return sum(e.topped_up for e in self.top_level)

    @property
    def overrun(self) -> float:
        return sum(e.overrun for e in self.episodes)

    @property
    def by_item(self) -> dict[tuple[str, str], dict[str, float]]:
        return _merge(e.by_item for e in self.episodes)

    @property
    def refusals(self) -> dict[str, dict[str, float]]:
        return _merge(e.refusals for e in self.episodes)

    @property
    def top_ups(self) -> list[dict[str, Any]]:
        return [t for e in self.episodes for t in e.top_ups]

    def spent_by_kind(self) -> dict[str, float]:
        """tool / model / oracle: every episode's own runs; sub_agent: the top-level episodes' carves
        (a grandchild's carve is inside its parent's)."""
        totals: dict[str, float] = {}
        for e in self.episodes:
            for kind, spent in e.by_kind.items():
                if kind != "sub_agent" or not e.parent:
                    totals[kind] = totals.get(kind, 0.0) + spent
        return totals

    # ---------------------------------------------------------------- views
    def to_dict(self) -> dict[str, Any]:
        return {
            "sources": self.sources,
            "skipped": self.skipped,
            "totals": {"episodes": len(self.episodes), "sub_agent_episodes": len(self.episodes) - len(self.top_level),
                       "budget": self.budget, "spent": self.spent, "left": self.left, "top_ups": self.topped_up,
                       "overrun": self.overrun, "refused": sum(e.refused for e in self.episodes),
                       "spent_by_kind": self.spent_by_kind()},
            "by_item": _item_rows(self.by_item),
            "refusals": _refusal_rows(self.refusals),
            "top_ups": self.top_ups,
            "episodes": [e.to_dict() for e in self.episodes],
        }

    def to_markdown(self) -> str:
        kinds = self.spent_by_kind()
        lines = ["# Budget report", "", f"Source: {', '.join(self.sources) or 'records in memory'}", ""]
        if self.skipped:
            lines += [f"Skipped: {', '.join(self.skipped)}", ""]
        lines += [
            "| episodes | of them sub-agents | budget (incl. top-ups) | spent | left | top-ups | overrun | tools "
            "| models | oracle | of the spend, by sub-agents |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {len(self.episodes)} | {len(self.episodes) - len(self.top_level)} | {_money(self.budget)} | "
            f"{_money(self.spent)} | {_money(self.left)} | {_money(self.topped_up)} | {_money(self.overrun)} | "
            + " | ".join(_money(kinds.get(k, 0.0)) for k in KINDS) + " |",
        ]
        over = [e for e in self.top_level if e.over_budget]
        if over:
            lines += ["", f"Over budget: {len(over)} episode{'s' if len(over) > 1 else ''} spent "
                          f"{_money(sum(e.over_budget for e in over))} more than their budgets (a guard with "
                          "enforce=False, as Raw and Prompt run, does not refuse; or bills above their reservations)"]
        lines += ["", "## Spend by tool and by model", ""]
        items = sorted(self.by_item.items(), key=lambda kv: (-kv[1]["spent"], kv[0]))
        if items:
            lines += ["| kind | name | spent | runs | failed | input tokens | output tokens | cached tokens "
                      "| cache-write tokens |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
            for (kind, name), row in items:
                tokens = [str(int(row[k])) if kind in ("model", "oracle") else "" for k in _TOKEN_KEYS]
                lines.append(f"| {kind} | {_cell(name)} | {_money(row['spent'])} | {int(row['runs'])} | "
                             f"{int(row['failed'])} | " + " | ".join(tokens) + " |")
            if "sub_agent" in kinds:
                lines += ["", "sub_agent rows are carves of the parent's budget; the sub-agents' own tool and "
                          "model runs are in the rows above when their logs are included."]
        else:
            lines.append("None.")
        lines += ["", "## Refusals", ""]
        refusals = sorted(self.refusals.items(), key=lambda kv: (-kv[1]["count"], kv[0]))
        if refusals:
            lines += ["| reason | count | would have cost |", "|---|---:|---:|"]
            lines += [f"| {_cell(reason)} | {int(row['count'])} | {_money(row['price'])} |" for reason, row in refusals]
        else:
            lines.append("None.")
        lines += ["", "## Top-ups", ""]
        if self.top_ups:
            lines += ["| episode | amount | approved by | reason |", "|---|---:|---|---|"]
            lines += [f"| {_cell(t['episode'])} | {_money(t['amount'])} | {_cell(t['approved_by'])} | "
                      f"{_cell(t['reason'])} |" for t in self.top_ups]
        else:
            lines.append("None.")
        lines += ["", "## Episodes", ""]
        if self.episodes:
            lines += ["| episode | parent | budget | spent | left | tools | models | oracle | sub-agents | top-ups "
                      "| refusals |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for e in sorted(self.episodes, key=lambda e: e.episode):
                k = e.by_kind
                lines.append(f"| {_cell(e.episode)} | {_cell(e.parent)} | {_money(e.budget)} | {_money(e.spent)} | "
                             f"{_money(e.left)} | " + " | ".join(_money(k.get(kind, 0.0)) for kind in KINDS)
                             + f" | {_money(e.topped_up)} | {e.refused} |")
        else:
            lines.append("No records.")
        return "\n".join(lines) + "\n"

    def plot(self, path: str | Path) -> Path:
        """A PNG: spend by kind per episode against its budget, and total spend by tool / model.

        Drawn on an Agg canvas without pyplot, so it neither needs a display nor switches the
        backend of a session (a notebook) that imported this module.
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        path = Path(path)
        episodes = sorted(self.episodes, key=lambda e: -e.spent)
        shown = episodes[:MAX_PLOTTED_EPISODES]
        fig = Figure(figsize=(13, 4.8))
        FigureCanvasAgg(fig)
        ax1, ax2 = fig.subplots(1, 2)
        x = list(range(len(shown)))
        bottom = [0.0] * len(shown)
        for kind in KINDS:
            heights = [e.by_kind.get(kind, 0.0) for e in shown]
            if any(heights):
                ax1.bar(x, heights, bottom=bottom, label=kind, color=_COLORS[kind])
                bottom = [b + h for b, h in zip(bottom, heights)]
        if shown:
            ax1.scatter(x, [e.budget for e in shown], marker="_", s=300, color="black", label="budget", zorder=3)
            ax1.set_xticks(x, [e.episode[:14] for e in shown], rotation=60, ha="right", fontsize=7)
            ax1.legend(fontsize=8)
        else:
            ax1.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax1.transAxes)
        title = "spend per episode vs budget"
        if len(episodes) > MAX_PLOTTED_EPISODES:
            title += f" (the {MAX_PLOTTED_EPISODES} largest of {len(episodes)} episodes)"
        ax1.set_title(title)
        ax1.set_ylabel("money")
        ranked = sorted(self.by_item.items(), key=lambda kv: (-kv[1]["spent"], kv[0]))
        items = ranked[:MAX_PLOTTED_ITEMS][::-1]
        ax2.barh([f"{k}: {n}" for (k, n), _ in items], [row["spent"] for _, row in items],
                 color=[_COLORS.get(k, "gray") for (k, _), _ in items])
        title = "total spend by tool and model"
        if len(ranked) > MAX_PLOTTED_ITEMS:
            title += f" (the {MAX_PLOTTED_ITEMS} largest of {len(ranked)})"
        ax2.set_title(title)
        ax2.set_xlabel("money")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        return path

    def write(self, out: str | Path) -> list[Path]:
        """``budget_report.md``, ``.json`` and ``.png`` in the directory ``out``; returns their paths."""
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise UsageError(f"{out} is a file; --out takes a directory to write budget_report.* into")
        out.mkdir(parents=True, exist_ok=True)
        md, js = out / "budget_report.md", out / "budget_report.json"
        md.write_text(self.to_markdown(), encoding="utf-8")
        js.write_text(json.dumps(self.to_dict(), indent=2), encoding="utf-8")
        return [md, js, self.plot(out / "budget_report.png")]


def _read(source: str | Path | Iterable[StepRecord]) -> tuple[list[tuple[str, StepRecord]], list[str], list[str]]:
    """The records, each with the directory of its log relative to the given one ('' for the log or records
    given), the logs they came from, and the *.jsonl files skipped as not guard logs."""
    if not isinstance(source, (str, Path)):
        if not isinstance(source, Iterable) or isinstance(source, (bytes, Mapping)):
            raise UsageError(f"budget_report takes a guard log's path, a run directory or StepRecords, got "
                             f"{type(source).__name__} {source!r:.60}; pass e.g. budget_report('runs/x/logs.jsonl')")
        records = list(source)
        for i, r in enumerate(records):
            if not isinstance(r, StepRecord):
                raise UsageError(f"budget_report: record {i} is a {type(r).__name__}, not a StepRecord; pass the "
                                 "records of a MemoryLogSink (sink.records) or read_log(path)")
        return [("", r) for r in records], [], []
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass a guard log (.jsonl) or a run directory")
    if not path.is_dir():
        return [("", r) for r in read_log(path, skip_torn_tail=True)], [str(path)], []
    records: list[tuple[str, StepRecord]] = []
    used: list[str] = []
    skipped: list[str] = []
    for f in sorted(path.rglob("*.jsonl")):
        if ORACLE_DATA in f.relative_to(path).parts:
            # A benchmark's oracle_data/: the oracle models' training logs, collected by another agent on other
            # tasks (eval.oracle_methods), not the run's spending.
            skipped.append(f"{f} (the oracle models' training logs)")
            continue
        try:
            where = f.parent.relative_to(path).as_posix()
            records += [("" if where == "." else where, r) for r in read_log(f, skip_torn_tail=True)]
        except LogFormatError:
            skipped.append(f"{f} (not a guard log)")  # another JSONL file of the run (results, progress)
            continue
        used.append(str(f))
    if not used:
        found = f" ({len(skipped)} *.jsonl files, none of them a guard log)" if skipped else ""
        raise UsageError(f"{path} holds no guard log{found}: expected *.jsonl files written by "
                         "BudgetGuard(log_sink=JsonlLogSink(...))")
    return records, used, skipped


def budget_report(source: str | Path | Iterable[StepRecord], *, out: str | Path | None = None) -> BudgetReport:
    """The report of a guard log, a run directory (every guard log under it), or records.

    With ``out`` (a directory), also writes ``budget_report.md``, ``.json`` and ``.png`` there.
    """
    records, sources, skipped = _read(source)
    # An episode is its task id within one directory: runs in different directories (a study's sweeps,
    # the same configuration run twice) reuse ids like raw:syn-0-0000:0 and are different episodes, while
    # the logs of one directory (two processes of one thread) are one episode's records. An id found in
    # more than one directory is labelled with its directory ("budget-0.5/raw:syn-0-0000:0").
    dirs: dict[str, set[str]] = {}
    for where, r in records:
        dirs.setdefault(r.task_id, set()).add(where)

    def label(where: str, task_id: str) -> str:
        return f"{where}/{task_id}" if len(dirs.get(task_id, ())) > 1 else task_id

    episodes: dict[tuple[str, str], EpisodeBudget] = {}
    for where, r in sorted(records, key=lambda wr: wr[1].timestamp):  # stable: equal timestamps keep log order
        episodes.setdefault((where, r.task_id), EpisodeBudget(label(where, r.task_id))).add(r)
    for where, r in records:
        if r.kind == "sub_agent" and r.tool.startswith("sub-agent:"):  # the carve names the child's episode
            child = episodes.get((where, r.tool.split(":", 1)[1]))  # a parent link stays within its directory
            if child is not None and child is not episodes.get((where, r.task_id)):
                child.parent = label(where, r.task_id)
    report = BudgetReport(list(episodes.values()), sources, skipped)
    if out is not None:
        report.write(out)
    return report


def open_existing_store(url: str) -> Any:
    """The store at ``url`` (``--store``) for a command that reads or prunes it: a SQLite URL must name an existing
    file (opening a store at a mistyped path would create an empty database there)."""
    from intent.stores import open_store

    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).is_file():
        raise UsageError(f"--store {url}: no SQLite database at {url[len('sqlite:///'):]!r}; check the path "
                         "(sqlite:///relative/path.db, or sqlite:////absolute/path.db)")
    return open_store(url)


def shared_budget_report(store: Any, key: str) -> str:
    """A shared budget's money (``intent report --store URL --key K``): its budget, spent, held
    and left, and its committed charges by run, by tool / model, with expired leases and late
    commits. ``store`` is a :class:`~intent.stores.BudgetStore` or its URL."""
    if isinstance(store, str):
        store = open_existing_store(store)
    from intent.stores.base import from_nano, to_nano

    store.expire_leases(key)  # a lease that ran out is released before it is reported
    charges = store.charges(key)
    budget, spent, held = store.budget(key), store.spent(key), store.reserved(key)
    committed = [c for c in charges if c.status == "committed"]
    by_run: dict[str, list[float]] = {}
    by_item: dict[tuple[str, str], list[float]] = {}
    for c in committed:
        by_run.setdefault(c.run_id or "-", [0.0, 0])
        by_run[c.run_id or "-"][0] += c.amount
        by_run[c.run_id or "-"][1] += 1
        by_item.setdefault((c.kind, c.tool or "-"), [0.0, 0])
        by_item[(c.kind, c.tool or "-")][0] += c.amount
        by_item[(c.kind, c.tool or "-")][1] += 1
    # (A store written before currencies, or a user's own without currency(): none to name.)
    currency = store.currency(key) if callable(getattr(store, "currency", None)) else None
    lines = [f"# Shared budget {_cell(key)}" + (f" ({_cell(currency)})" if currency else ""), "",
             "| budget | spent | reserved | left | charges | expired leases | late commits |",
             "|---:|---:|---:|---:|---:|---:|---:|",
             f"| {_money(budget)} | {_money(spent)} | {_money(held)} | {_money(max(0.0, budget - spent - held))} | "
             f"{len(committed)} | {sum(1 for c in charges if c.status == 'expired')} | "
             f"{sum(1 for c in committed if c.late)} |", ""]
    pruned = to_nano(spent) - sum(to_nano(c.amount) for c in committed)  # (exact: money is integer nano-units)
    if pruned > 0:
        lines += [f"{_money(from_nano(pruned))} of spent was charged by charges pruned from the store's history "
                  "(store.prune): the charges counted above and the tables below cover the rest.", ""]
    lines += ["## By run", "", "| run | spent | charges |", "|---|---:|---:|"]
    for run, (amount, n) in sorted(by_run.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {_cell(run)} | {_money(amount)} | {n} |")
    lines += ["", "## By tool and model", "", "| kind | name | spent | charges |", "|---|---|---:|---:|"]
    for (kind, name), (amount, n) in sorted(by_item.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {kind} | {_cell(name)} | {_money(amount)} | {n} |")
    held_now = sorted((c for c in charges if c.status == "reserved"), key=lambda c: c.lease_until)
    if held_now:
        # Whose money is held, and until when: a worker killed mid-call holds its money until its lease ends; an
        # operator who knows it is dead gives it back at once with store.release(key, charge_id).
        lines += ["", "## Held", "", "| run | tool | held | charge id | lease ends (UTC) |", "|---|---|---:|---|---|"]
        for c in held_now:
            ends = _dt.datetime.fromtimestamp(c.lease_until, _dt.timezone.utc).isoformat(timespec="seconds")
            lines.append(f"| {_cell(c.run_id or '-')} | {_cell(c.tool or '-')} | {_money(c.amount)} | "
                         f"{_cell(c.charge_id)} | {ends} |")
    return "\n".join(lines) + "\n"
