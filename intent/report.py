"""The budget report a person reads: where the money went, per episode and in total.

``budget_report(source)`` reads the guard's JSONL logs (a file, a run directory searched for
``*.jsonl``, or records already in memory) with :func:`intent.logs.read_log`, and returns a
:class:`BudgetReport`: spend by tool and by model (and the oracle's and sub-agents' spend as
their own rows), refusals by reason, top-ups with who approved them, and what is left.
``to_markdown()`` gives the tables, ``plot(path)`` a PNG, ``write(out_dir)`` all three files.
``intent report RUN_DIR_OR_LOG [--out DIR]`` is the command line.

The numbers are sums of the log's own fields: a record's ``charged`` is what that record
charged (Σ over an episode == its spend), ``remaining`` / ``budget`` are the ledger after it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from intent.logs import LogFormatError, StepRecord, read_log

__all__ = ["BudgetReport", "EpisodeBudget", "budget_report"]

_MAX_PLOTTED = 40
_KINDS = ("tool", "model", "oracle", "sub_agent")


def _money(x: float) -> str:
    return f"{x:.6g}"


@dataclass
class EpisodeBudget:
    """One episode's money, from its records."""

    episode: str
    budget: float = 0.0
    spent: float = 0.0
    left: float = 0.0
    overrun: float = 0.0
    by_kind: dict[str, float] = field(default_factory=dict)
    top_ups: float = 0.0
    refusals: int = 0
    parent: str = ""  # a sub-agent's episode: its spend is already its parent's sub_agent charge


@dataclass
class BudgetReport:
    """Spend by tool / model, refusals, top-ups and what is left, per episode and in total."""

    episodes: list[EpisodeBudget]
    # (kind, name) -> {"spent", "runs", "input", "output", "cached"}
    by_item: dict[tuple[str, str], dict[str, float]]
    # reason -> {"count", "price"} (price: what the refused calls would have cost, when known)
    refusals: dict[str, dict[str, float]]
    top_ups: list[dict[str, Any]]
    sources: list[str] = field(default_factory=list)

    # ------------------------------------------------------------- totals
    # Every dollar once: a sub-agent's episode spends out of its parent's carve, so the totals sum
    # the top-level episodes only, and split them by the kinds that really spent (tool, model,
    # oracle); the sub_agent rows say how much of it sub-agents spent.
    @property
    def top_level(self) -> list[EpisodeBudget]:
        return [e for e in self.episodes if not e.parent]

    @property
    def spent(self) -> float:
        return sum(e.spent for e in self.top_level)

    @property
    def budget(self) -> float:
        return sum(e.budget for e in self.top_level)

    @property
    def left(self) -> float:
        return sum(e.left for e in self.top_level)

    @property
    def topped_up(self) -> float:
        return sum(t["amount"] for t in self.top_ups)

    def spent_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (kind, _), row in self.by_item.items():
            out[kind] = out.get(kind, 0.0) + row["spent"]
        return out

    # -------------------------------------------------------------- views
    def to_dict(self) -> dict[str, Any]:
        return {
            "sources": self.sources,
            "totals": {"episodes": len(self.episodes), "budget": self.budget, "spent": self.spent,
                       "left": self.left, "top_ups": self.topped_up, "spent_by_kind": self.spent_by_kind(),
                       "overrun": sum(e.overrun for e in self.episodes)},
            "by_item": [{"kind": k, "name": n, **row} for (k, n), row in sorted(self.by_item.items())],
            "refusals": [{"reason": r, **row} for r, row in sorted(self.refusals.items())],
            "top_ups": self.top_ups,
            "episodes": [vars(e) for e in self.episodes],
        }

    def to_markdown(self) -> str:
        kinds = self.spent_by_kind()
        lines = [
            "# Budget report", "",
            f"Source: {', '.join(self.sources) or 'records in memory'}", "",
            "| episodes | of them sub-agents | budget (incl. top-ups) | spent | left | top-ups | tools | models "
            "| oracle | of the spend, by sub-agents |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {len(self.episodes)} | {len(self.episodes) - len(self.top_level)} | {_money(self.budget)} | "
            f"{_money(self.spent)} | {_money(self.left)} | {_money(self.topped_up)} | "
            f"{_money(kinds.get('tool', 0.0))} | {_money(kinds.get('model', 0.0))} | "
            f"{_money(kinds.get('oracle', 0.0))} | {_money(kinds.get('sub_agent', 0.0))} |",
            "", "## Spend by tool and by model", "",
            "| kind | name | spent | runs | input tokens | output tokens | cached tokens |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for (kind, name), row in sorted(self.by_item.items(), key=lambda kv: -kv[1]["spent"]):
            tokens = [str(int(row[k])) if kind in ("model", "oracle") else "" for k in ("input", "output", "cached")]
            lines.append(f"| {kind} | {name} | {_money(row['spent'])} | {int(row['runs'])} | " + " | ".join(tokens)
                         + " |")
        lines += ["", "## Refusals", ""]
        if self.refusals:
            lines += ["| reason | count | would have cost |", "|---|---:|---:|"]
            for reason, row in sorted(self.refusals.items(), key=lambda kv: -kv[1]["count"]):
                lines.append(f"| {reason} | {int(row['count'])} | {_money(row['price'])} |")
        else:
            lines.append("None.")
        lines += ["", "## Top-ups", ""]
        if self.top_ups:
            lines += ["| episode | amount | approved by | reason |", "|---|---:|---|---|"]
            for t in self.top_ups:
                lines.append(f"| {t['episode']} | {_money(t['amount'])} | {t['approved_by'] or '-'} | "
                             f"{t['reason'] or '-'} |")
        else:
            lines.append("None.")
        lines += ["", "## Episodes", "",
                  "| episode | parent | budget | spent | left | tools | models | oracle | sub-agents | top-ups | refusals |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for e in sorted(self.episodes, key=lambda e: e.episode):
            k = e.by_kind
            lines.append(
                f"| {e.episode} | {e.parent or '-'} | {_money(e.budget)} | {_money(e.spent)} | {_money(e.left)} | "
                f"{_money(k.get('tool', 0.0))} | {_money(k.get('model', 0.0))} | {_money(k.get('oracle', 0.0))} | "
                f"{_money(k.get('sub_agent', 0.0))} | {_money(e.top_ups)} | {e.refusals} |")
        return "\n".join(lines) + "\n"

    def plot(self, path: str | Path) -> Path:
        """A PNG: spend by kind per episode against its budget, and total spend by tool / model."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        episodes = sorted(self.episodes, key=lambda e: -e.spent)
        shown = episodes[:_MAX_PLOTTED]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
        x = list(range(len(shown)))
        bottom = [0.0] * len(shown)
        for kind in _KINDS:
            heights = [e.by_kind.get(kind, 0.0) for e in shown]
            if any(heights):
                ax1.bar(x, heights, bottom=bottom, label=kind)
                bottom = [b + h for b, h in zip(bottom, heights)]
        ax1.scatter(x, [e.budget for e in shown], marker="_", s=300, color="black", label="budget", zorder=3)
        ax1.set_xticks(x, [e.episode[:14] for e in shown], rotation=60, ha="right", fontsize=7)
        title = "spend per episode vs budget"
        if len(episodes) > _MAX_PLOTTED:
            title += f" (the {_MAX_PLOTTED} largest of {len(episodes)})"
        ax1.set_title(title)
        ax1.set_ylabel("money")
        ax1.legend(fontsize=8)
        items = sorted(self.by_item.items(), key=lambda kv: -kv[1]["spent"])[:20]
        ax2.barh([f"{k}: {n}" for (k, n), _ in items][::-1], [row["spent"] for _, row in items][::-1])
        ax2.set_title("total spend by tool and model")
        ax2.set_xlabel("money")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def write(self, out: str | Path) -> list[Path]:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        md, js = out / "budget_report.md", out / "budget_report.json"
        md.write_text(self.to_markdown())
        js.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        return [md, js, self.plot(out / "budget_report.png")]


def _records(source: str | Path | Iterable[StepRecord]) -> tuple[list[StepRecord], list[str]]:
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; pass a guard log (.jsonl) or a run directory")
        if path.is_dir():
            files = sorted(path.rglob("*.jsonl"))
            records: list[StepRecord] = []
            used: list[str] = []
            for f in files:
                try:
                    records += list(read_log(f, skip_torn_tail=True))
                except LogFormatError:
                    continue  # another JSONL file in the run (results, progress): not a guard log
                used.append(str(f))
            if not used:
                raise ValueError(f"{path} holds no guard log: expected *.jsonl files written by "
                                 "BudgetGuard(log_sink=JsonlLogSink(...))")
            return records, used
        return list(read_log(path, skip_torn_tail=True)), [str(path)]
    return list(source), []


def budget_report(source: str | Path | Iterable[StepRecord], *, out: str | Path | None = None) -> BudgetReport:
    """The report of a guard log, a run directory, or records; written to ``out`` when given."""
    records, sources = _records(source)
    episodes: dict[str, EpisodeBudget] = {}
    by_item: dict[tuple[str, str], dict[str, float]] = {}
    refusals: dict[str, dict[str, float]] = {}
    top_ups: list[dict[str, Any]] = []
    for r in sorted(records, key=lambda r: r.timestamp):
        kind = getattr(r, "kind", "tool")
        ep = episodes.setdefault(r.task_id, EpisodeBudget(r.task_id))
        ep.budget, ep.left = r.budget, r.remaining
        ep.spent += r.charged
        ep.overrun += r.overrun
        if r.charged:
            ep.by_kind[kind] = ep.by_kind.get(kind, 0.0) + r.charged
        if r.decision == "top_up":
            ep.top_ups += r.price or 0.0
            top_ups.append({"episode": r.task_id, "amount": r.price or 0.0,
                            "approved_by": getattr(r, "approved_by", ""), "reason": r.reason})
        elif r.decision in ("reject", "invalid"):
            ep.refusals += 1
            row = refusals.setdefault(r.reason or r.decision, {"count": 0.0, "price": 0.0})
            row["count"] += 1
            row["price"] += r.price or 0.0
        elif r.charged or r.execution > 0:
            item = by_item.setdefault((kind, r.tool or "?"),
                                      {"spent": 0.0, "runs": 0.0, "input": 0.0, "output": 0.0, "cached": 0.0})
            item["spent"] += r.charged
            item["runs"] += 1
            for key in ("input", "output", "cached"):
                item[key] += float((r.tokens or {}).get(key, 0))
    for r in records:
        if getattr(r, "kind", "tool") == "sub_agent" and (r.tool or "").startswith("sub-agent:"):
            child = episodes.get(r.tool.split(":", 1)[1])
            if child is not None:
                child.parent = r.task_id
    return_value = BudgetReport(list(episodes.values()), by_item, refusals, top_ups, sources)
    if out is not None:
        return_value.write(out)
    return return_value
