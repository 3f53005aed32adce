"""results.json -> results.md: the comparison table, with what produced each number."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eval.bench_command import bench_command
from eval.method_spec import DEFAULT_MAX_DEPTH

COLUMNS = (
    ("PR", "PR"), ("decision_regret", "Regret"), ("OR", "OR"), ("WR", "WR"), ("FR", "FR"), ("AC", "AC"), ("AP", "AP"),
    ("time_ratio", "Time×"), ("latency_ratio", "Lat.×"), ("token_ratio", "Tok.×"), ("n", "n"),
)


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _regret_cell(v: dict[str, Any]) -> str:
    """Regret, with the episodes it is over when a crashed one has none (it crashed before any decision)."""
    cell = _fmt(v.get("decision_regret"))
    if v.get("decision_regret_crashed_without") and v.get("decision_regret") is not None:
        cell += f" (n={v.get('decision_regret_n')}/{v.get('n')})"
    return cell


def markdown_table(summary: dict[str, Any]) -> str:
    head = "| method | " + " | ".join(label for _, label in COLUMNS) + " |"
    sep = "|---|" + "---:|" * len(COLUMNS)
    rows = [f"| {m} | " + " | ".join(_regret_cell(v) if k == "decision_regret" else _fmt(v.get(k))
                                     for k, _ in COLUMNS) + " |"
            for m, v in summary["methods"].items()]
    return "\n".join([head, sep, *rows])


def write_reports(summary: dict[str, Any], out: Path) -> str:
    cfg = summary["config"]
    text = "\n".join([
        f"# Benchmark: {cfg['market']} ({cfg['tasks']} tasks, seed {cfg['seed']}, {cfg['workers']} workers)",
        "",
        f"- command: `{command}`" if (command := bench_command(cfg)) else
        "- command: none; configured in Python (`eval.runner.BenchConfig`, as `intent bench study` does) with "
        "settings no `intent bench` flag gives",
        f"- market: {cfg['market_label']}",
        f"- agent: {cfg['agent_label']}",
        f"- judge: {cfg['judge']}",
        f"- world model (MCO/INTENT): {cfg.get('world_model')}; oracle models: {cfg.get('oracle_models')}"
        + (f"; rollouts cut at {cfg['rollout_depth']} model turns (the paper's horizon is {DEFAULT_MAX_DEPTH})"
           if cfg.get("rollout_depth", DEFAULT_MAX_DEPTH) != DEFAULT_MAX_DEPTH else ""),
        *[f"- oracle note: {note}" for note in cfg.get("oracle_notes") or ()],
        *([f"- agent's needs: {cfg['agent_needs']}"] if cfg.get("agent_needs") else []),
        *([f"- upper bounds (read the ground truth; not deployable): {', '.join(cfg['upper_bounds'])}"]
          if cfg.get("upper_bounds") else []),
        "- Regret: decision regret (exact DP; synthetic market, enforcing methods)"
        + (f"; collecting the oracle logs took {cfg.get('oracle_data_collection_s', 0.0):.1f} s and building the oracle "
           f"models {cfg.get('oracle_models_s', 0.0):.1f} s, neither in any Time×"
           if not str(cfg.get("world_model", "")).startswith("none") else ""),
        f"- WR reference: {cfg['reference']}; Time/Lat./Tok. are ratios to `raw` measured in this run",
        "- PR, OR, WR, FR in percent; AC = average cost per task; AP = average price per executed call",
        "",
        markdown_table(summary),
        "",
        *paired_lines(summary),
        *paired_regret_lines(summary),
        *regret_lines(summary),
    ])
    (out / "results.md").write_text(text)
    return text


def regret_lines(summary: dict[str, Any]) -> list[str]:
    """Decision regret pooled over every audited decision, split by kind (synthetic market only)."""
    rows = {m: r for m, r in summary["methods"].items() if r.get("reject_share") is not None}
    if not rows:
        return []
    lines = ["Decision regret by kind, pooled over every audited decision (the table's Regret averages each "
             "episode's mean): what an acceptance lost, what a rejection lost, and how often the oracle rejected:",
             "", "| method | per acceptance | per rejection | rejections |", "|---|---:|---:|---:|"]
    for m, r in rows.items():
        lines.append(f"| {m} | {_fmt(r.get('regret_per_accept'))} | {_fmt(r.get('regret_per_reject'))} | "
                     f"{100 * r['reject_share']:.1f}% |")
    reasons = sorted({k for r in rows.values() for k in (r.get("regret_by_reason") or {})})
    if reasons:
        lines += ["", "The same by the oracle's reason for each decision (mean regret, and in brackets the share of "
                  "the method's audited decisions with that reason):", "",
                  "| method | " + " | ".join(reasons) + " |", "|---|" + "---:|" * len(reasons)]
        for m, r in rows.items():
            got = r.get("regret_by_reason") or {}
            cells = [f"{_fmt(got[k]['regret'])} ({100 * got[k]['share']:.1f}%)" if k in got else "–" for k in reasons]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def paired_regret_lines(summary: dict[str, Any]) -> list[str]:
    """Paired decision-regret differences (same tasks, same seed) with bootstrap 95% intervals."""
    lines: list[str] = []
    for base, rows in (summary.get("paired_regret") or {}).items():
        rows = {m: v for m, v in rows.items() if v["n"]}
        if not rows:
            continue
        lines += [f"Decision regret minus {base}'s on the same tasks (lower is better; paired bootstrap 95% "
                  "interval; tasks with a decision of both; tasks lower / higher):", "",
                  "| method | ΔRegret | 95% interval | tasks | lower | higher |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {m} | {v['diff']:+.3f} | [{v['ci95'][0]:+.3f}, {v['ci95'][1]:+.3f}] | {v['n']} | {v['lower']} | "
                  f"{v['higher']} |" for m, v in rows.items()]
        lines.append("")
    return lines


def paired_lines(summary: dict[str, Any]) -> list[str]:
    """Paired PR differences (same tasks, same seed) with bootstrap 95% intervals, per base method."""
    lines: list[str] = []
    for base, rows in (summary.get("paired") or {}).items():
        if not rows:
            continue
        lines += [f"PR minus {base}'s PR on the same tasks (percentage points; paired bootstrap 95% interval; "
                  "tasks both ran; tasks better / worse):", "",
                  "| method | ΔPR | 95% interval | tasks | better | worse |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {m} | {v['diff']:+.2f} | [{v['ci95'][0]:+.2f}, {v['ci95'][1]:+.2f}] | {v['n']} | "
                  f"{v['better']} | {v['worse']} |" for m, v in rows.items()]
        lines.append("")
    return lines
