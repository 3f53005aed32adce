"""The benchmark with a served chat model, plus what the results table does not show (``make bench-llm``).

``python -m eval.agents.llm_bench --base-url URL --model NAME [--markets synthetic,stabletoolbench]
[--methods raw,prompt,tracker,intent] [--tasks 10] [--stb-tasks 5] [--out runs/bench-llm]``

For each market it runs ``eval.runner.run_benchmark`` once per method (one method at a time, into
the same run directory, so the server's counters can be attributed to a method), then once more
with every method, which runs nothing new and prints the usual table. Per method it writes
``OUT/<market>/llm_stats.json`` and prints:

* ``PR``, ``FR``, ``AC`` (mean cost) and ``crashed`` from the runner's metrics;
* ``s/ep``: mean wall time per episode; ``tok/ep``: agent tokens (prompt + completion) per episode;
* ``calls``: tool calls the model proposed (the guard's ``logs.jsonl``, one per call id; an episode a
  resumed run re-ran counts by the attempt whose result is kept, selected by its attempt number); ``dup%``: those identical (tool and arguments) to an
  earlier proposal of the same model turn; ``inv%``: those the guard refused as invalid for another
  reason than duplication (unknown tool, bad arguments);
* ``malf%``: model replies in which the server's lenient parser saw a call attempt it could not parse
  (``INTENT_TOOL_PARSE_LOG``, written by ``intent_vllm/vllm_plugin.py``; empty for other servers);
* ``cap%``: replies cut by ``--max-tokens`` (vLLM's ``request_success_total{finished_reason="length"}``);
* ``gen tok/s`` and ``all tok/s``: the server's generated and prompt + generated tokens per second of
  the method's run (vLLM's ``/metrics`` counters), ``cache%`` its prefix-cache hit rate; and
  ``usage tok/s``: the agent's usage tokens over the method's wall time (any server).

A method whose episodes were already in the run directory keeps its earlier server numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from eval.episode_log import attempt_of, episode_id, kept_attempts, last_attempts
from eval.results import EpisodeResult, ResultStore
from intent.errors import IntentError, LogFormatError, UsageError
from intent.logs import StepRecord, read_log, read_log_rows
from intent.oracle import DUPLICATE_CALL

__all__ = ["main", "parse_log_totals", "parse_metrics", "proposal_stats", "read_metrics", "server_stats"]

_METRIC = re.compile(r"^(vllm:[A-Za-z0-9_:]+)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)\s*$")
_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_hits_total",
             "vllm:prefix_cache_queries_total", "vllm:request_success_total")


def read_metrics(base_url: str, timeout: float = 5.0) -> dict[str, float]:
    """vLLM's Prometheus counters (summed over labels); {} when the server has no /metrics."""
    root = re.sub(r"/v1/?$", "", base_url.rstrip("/"))
    try:
        with urllib.request.urlopen(root + "/metrics", timeout=timeout) as response:  # noqa: S310
            text = response.read().decode(errors="replace")
    except (OSError, ValueError):
        return {}
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m:
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            totals[m.group(1)] += value
            if 'finished_reason="length"' in (m.group(2) or ""):  # replies cut by max_tokens
                totals[m.group(1) + "{length}"] += value
    return dict(totals)


def parse_log_totals(path: str | os.PathLike[str] | None, skip: int = 0) -> tuple[int, dict[str, int]]:
    """(rows in the parser's log, totals of its rows after the first ``skip``).

    Read by the guard logs' reader: a torn last row (no newline yet: the server is writing it) waits for the
    next read; any other row that is not a JSON object is an error naming the file and line.
    """
    totals = {"replies": 0, "calls": 0, "malformed": 0, "duplicates": 0, "unknown": 0, "malformed_replies": 0}
    if not path or not Path(path).exists():
        return 0, totals
    rows = _parser_log_rows(path)
    for row in rows[skip:]:
        totals["replies"] += 1
        for key in ("calls", "malformed", "duplicates", "unknown"):
            totals[key] += int(row.get(key, 0))
        totals["malformed_replies"] += int(row.get("malformed", 0) > 0)
    return len(rows), totals


def _parser_log_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    try:
        # Its rows carry no schema_version (intent_vllm/vllm_plugin.py writes them, not intent's JsonlLogSink).
        return list(read_log_rows(path, require_version=False))
    except LogFormatError as exc:
        raise LogFormatError(f"the tool parser's log (--parse-log, INTENT_TOOL_PARSE_LOG): {exc}. Fix or delete "
                             "that line, or point --parse-log at a new file") from exc


def server_stats(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, Any]:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    if not after or seconds <= 0:
        return {}
    gen, prompt = delta("vllm:generation_tokens_total"), delta("vllm:prompt_tokens_total")
    queries = delta("vllm:prefix_cache_queries_total")
    requests = delta("vllm:request_success_total")
    return {"server_generation_tokens": int(gen), "server_prompt_tokens": int(prompt),
            "server_requests": int(requests),
            "length_capped_pct": round(100 * delta("vllm:request_success_total{length}") / requests, 1)
            if requests else None,
            "server_gen_tok_s": round(gen / seconds, 1), "server_total_tok_s": round((gen + prompt) / seconds, 1),
            "prefix_cache_hit_pct": round(100 * delta("vllm:prefix_cache_hits_total") / queries, 1) if queries else None}


def proposal_stats(logs_path: Path, method: str, seed: int, task_ids: Iterable[str],
                   results: Iterable[EpisodeResult] | None = None) -> dict[str, int]:
    """Tool calls ``method``'s agent proposed on the tasks ``task_ids`` (its episodes in ``episodes.jsonl``), from
    the guard log: ``proposals``; ``duplicates``, those repeating an earlier proposal's tool and arguments in the
    same model turn (episode and step); and ``invalid``, those the guard refused as invalid for another reason
    (unknown tool, bad arguments). An episode a resumed run re-ran counts by one attempt: given ``results`` (the
    method's saved results, in file order, re-runs included), the attempt whose result ``episodes.jsonl`` keeps,
    selected by its attempt number (eval/episode_log.py); without them, the last attempt logged."""
    counts = {"proposals": 0, "duplicates": 0, "invalid": 0}
    if not logs_path.exists():
        return counts
    # Whole ids: a prefix 'method:' would also take in the episodes of a method named 'method:variant'.
    ids = {episode_id(method, task, seed) for task in task_ids}
    if results is None:
        chosen = last_attempts(read_log(logs_path), ids)
    else:
        saved: dict[str, list[int | None]] = {}
        for r in results:
            eid = episode_id(r.method, r.task_id, r.seed)
            if eid in ids:
                saved.setdefault(eid, []).append(attempt_of(r))
        chosen = {eid: kept.records for eid, kept in kept_attempts(read_log(logs_path), saved).items()}
    for records in chosen.values():
        _count_proposals(records, counts)
    return counts


def _count_proposals(records: list[StepRecord], counts: dict[str, int]) -> None:
    """Add one attempt's proposals to ``counts``. A call id is one proposal however many records it has (a
    retried run, a merged duplicate answered later)."""
    firsts: dict[int, dict[str, StepRecord]] = defaultdict(dict)  # step -> call id -> its first record
    for rec in records:
        if rec.decision != "top_up":  # a budget top-up (logged at step -1) is no proposal
            firsts[rec.step].setdefault(rec.call_id, rec)
    for calls in firsts.values():
        seen: set[tuple[str, str]] = set()
        for rec in calls.values():
            key = (rec.tool, json.dumps(rec.args, sort_keys=True))
            counts["proposals"] += 1
            counts["duplicates"] += key in seen
            seen.add(key)
            counts["invalid"] += rec.decision == "invalid" and rec.reason != DUPLICATE_CALL


def _results(out: Path, method: str, seed: int) -> list[EpisodeResult]:
    """Every result the method's episodes wrote, in file order, a crashed episode's re-run included."""
    # Read only: the runner cuts a torn last line itself when it resumes.
    results = ResultStore(out / "episodes.jsonl").load(repair=False)
    return [r for r in results if r.method == method and r.seed == seed]


def method_stats(out: Path, method: str, seed: int, metrics: dict[str, Any]) -> dict[str, Any]:
    saved = _results(out, method, seed)
    rows = list({r.task_id: r for r in saved}.values())  # the latest result of each task (a re-run replaces a crash)
    n = len(rows)
    tokens = sum(r.agent_tokens for r in rows)
    wall = sum(r.wall_s for r in rows)
    p = proposal_stats(out / "logs.jsonl", method, seed, [r.task_id for r in rows], results=saved)
    return {"episodes": n, "PR": metrics.get("PR"), "FR": metrics.get("FR"), "AC": metrics.get("AC"),
            "crashed": sum(r.crashed for r in rows),
            "context_full": sum(bool(r.extra.get("context_full")) for r in rows),
            "turn_limit": sum(bool(r.extra.get("turn_limit")) for r in rows),
            "wall_s_per_episode": round(wall / n, 2) if n else None,
            "agent_tokens": tokens, "agent_tokens_per_episode": round(tokens / n) if n else None,
            "proposed_calls": p["proposals"], "duplicate_calls": p["duplicates"], "invalid_calls": p["invalid"],
            "duplicate_call_pct": round(100 * p["duplicates"] / p["proposals"], 1) if p["proposals"] else None,
            "invalid_call_pct": round(100 * p["invalid"] / p["proposals"], 1) if p["proposals"] else None,
            # The planning oracles' own cost with the real model (their rollouts call it too).
            "oracle_tokens_per_episode": round(metrics["oracle_tokens"] / n) if n and metrics.get("oracle_tokens") else None,
            "decision_s_mean": (round(metrics["decision_ms_mean"] / 1000.0, 1)
                                if metrics.get("decision_ms_mean") is not None else None),
            "oracle_cache_hit_pct": (round(100 * metrics["cache_hit_rate"], 1)
                                     if metrics.get("cache_hit_rate") is not None else None),
            "rollouts_capped": metrics.get("rollouts_capped"),
            "errors": sorted({r.error[:160] for r in rows if r.error})}


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def stats_table(stats: dict[str, dict[str, Any]]) -> str:
    cols = [("PR", "PR"), ("FR", "FR"), ("AC", "AC"), ("crashed", "crashed"), ("ctx full", "context_full"), ("turn limit", "turn_limit"),
            ("s/ep", "wall_s_per_episode"),
            ("tok/ep", "agent_tokens_per_episode"), ("calls", "proposed_calls"), ("dup%", "duplicate_call_pct"),
            ("inv%", "invalid_call_pct"), ("malf%", "malformed_reply_pct"), ("cap%", "length_capped_pct"), ("gen tok/s", "server_gen_tok_s"),
            ("all tok/s", "server_total_tok_s"), ("cache%", "prefix_cache_hit_pct"), ("usage tok/s", "usage_tok_s"),
            ("oracle tok/ep", "oracle_tokens_per_episode"), ("s/decision", "decision_s_mean"),
            ("plan cache%", "oracle_cache_hit_pct"), ("capped rollouts", "rollouts_capped")]
    lines = ["| method | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for method, s in stats.items():
        lines.append(f"| {method} | " + " | ".join(_fmt(s.get(k)) for _, k in cols) + " |")
    return "\n".join(lines)


class _CollectionHeartbeat:
    """A line every 10 s while the runner collects the oracle's training logs (it prints none itself):
    INTENT, MCO and BTP first run the Prompt agent on ``--oracle-tasks`` tasks with the real model."""

    def __init__(self, out: Path, method: str, tasks: int, every_s: float = 10.0) -> None:
        import threading

        self.dir, self.method, self.tasks, self.every_s = out / "oracle_data", method, tasks, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.every_s):
            if (self.dir / "COMPLETE").exists():
                return
            logs = self.dir / "logs.jsonl"
            episodes = len({row.get("task_id") for row in read_log_rows(logs, require_version=False)}) if logs.exists() else 0
            if self._stop.is_set():
                return  # the collection ended while the logs were read: no line after the end
            print(f"  {self.method}: collecting oracle logs (Prompt agent, {self.tasks} tasks): {episodes} episodes "
                  f"with tool calls so far, {time.monotonic() - started:.0f} s", flush=True)

    def __enter__(self) -> _CollectionHeartbeat:
        if not (self.dir / "COMPLETE").exists():
            print(f"  {self.method} needs oracle logs: the Prompt agent first runs {self.tasks} tasks "
                  f"(--oracle-tasks), kept in {self.dir} for reuse", flush=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()  # a line being printed now comes before whatever follows the collection


def run_market(market: str, args: argparse.Namespace, methods: list[str]) -> dict[str, dict[str, Any]]:
    from eval.report import markdown_table
    from eval.runner import BenchConfig, run_benchmark

    out = Path(args.out) / market
    out.mkdir(parents=True, exist_ok=True)
    stats_path = out / "llm_stats.json"
    saved = json.loads(stats_path.read_text()).get("methods", {}) if stats_path.exists() else {}
    options: dict[str, Any] = {"base_url": args.base_url, "max_tokens": args.max_tokens, "timeout": args.request_timeout,
                               "max_turns": args.max_turns,
                               "oracle_train_tasks": args.oracle_tasks, "feedback_chars": args.feedback_chars}
    if args.rollout_max_tokens:
        options["rollout_max_tokens"] = args.rollout_max_tokens
    if args.max_depth is not None:
        options["max_depth"] = args.max_depth
    if args.allow_code_change:
        options["allow_code_change"] = True
    given_logs = args.oracle_logs_by_market.get(market)
    if given_logs:
        options["oracle_logs"] = given_logs
    if market == "stabletoolbench":
        options["solvability"] = args.solvability
        if args.stb_path:
            options["stb_path"] = args.stb_path
    tasks = args.tasks if market == "synthetic" else args.stb_tasks
    config = BenchConfig(market=market, methods=[methods[0]], agent=f"openai:{args.model}", tasks=tasks,
                         workers=args.workers, seed=args.seed, out=str(out), options=options)
    stats: dict[str, dict[str, Any]] = {}
    for method in methods:
        before_n = len(_results(out, method, args.seed))
        parsed_before, _ = parse_log_totals(args.parse_log)
        metrics_before = read_metrics(args.base_url)
        started = time.monotonic()
        print(f"== {market}: {method} ({tasks} tasks, agent openai:{args.model}) ==", flush=True)
        from contextlib import nullcontext

        from eval.methods import get_method

        needs_logs = get_method(method).needs_oracle_logs
        collect_tasks = tasks if market == "stabletoolbench" else args.oracle_tasks  # STB: cross-fitted folds
        if needs_logs and given_logs:
            print(f"  {method}: oracle models built from {given_logs} (--oracle-logs)", flush=True)
        with _CollectionHeartbeat(out, method, collect_tasks) if needs_logs and not given_logs else nullcontext():
            run_benchmark(replace(config, methods=[method]), progress=not args.no_progress)
        seconds = time.monotonic() - started
        results_now = _results(out, method, args.seed)[before_n:]  # re-runs of crashed ones count
        ran = len(results_now)
        if ran <= 0:
            # Nothing ran now (a resumed run): the server and parser figures of the run that made
            # these episodes are the saved ones, or unknown if that run was stopped before saving.
            stats[method] = dict(saved.get(method, {}))
            continue
        _, parsed = parse_log_totals(args.parse_log, skip=parsed_before)
        entry = {"run_seconds": round(seconds, 1), "run_agent_tokens": sum(r.agent_tokens for r in results_now),
                 **server_stats(metrics_before, read_metrics(args.base_url), seconds),
                 "parser": parsed,
                 "malformed_reply_pct": (round(100 * parsed["malformed_replies"] / parsed["replies"], 1)
                                         if parsed["replies"] else None)}
        stats[method] = entry
    # The table of what ran above: a crashed episode is listed, not quietly run again here.
    summary = run_benchmark(replace(config, methods=methods), progress=False, run_missing=False)
    for method in methods:
        row = summary["methods"].get(method, {})
        fresh = method_stats(out, method, args.seed, row)
        stats[method] = {**stats.get(method, {}), **fresh}
        # The agent's tokens of this run's episodes over this run's seconds (a resumed run's older
        # episodes took their time in another run).
        run_s, run_tokens = stats[method].get("run_seconds"), stats[method].get("run_agent_tokens")
        stats[method]["usage_tok_s"] = round(run_tokens / run_s, 1) if run_s and run_tokens is not None else None
    stats_path.write_text(json.dumps({"market": market, "model": args.model, "base_url": args.base_url,
                                      "tasks": tasks, "seed": args.seed, "workers": args.workers,
                                      "max_tokens": args.max_tokens, "rollout_max_tokens": args.rollout_max_tokens or None,
                                      "max_depth": args.max_depth,
                                      "methods": stats}, indent=2))
    cfg = summary["config"]
    print(f"\n{market}: {cfg['market_label']}; agent: {cfg['agent_label']}; judge: {cfg['judge']}")
    print(markdown_table(summary))
    rollout_cap = f", rollout replies <= {args.rollout_max_tokens} tokens" if args.rollout_max_tokens else ""
    rollout_cap += f", rollouts <= {args.max_depth} turns" if args.max_depth is not None else ""
    print(f"\nLLM path ({args.model}, {tasks} tasks, max_tokens {args.max_tokens}{rollout_cap}):")
    print(stats_table(stats))
    for method, s in stats.items():
        for err in s.get("errors", [])[:3]:
            print(f"  {method} crashed episode: {err}")
    print(f"results: {out}/results.json; LLM stats: {stats_path}")
    return stats


def oracle_logs_by_market(value: str | None, markets: list[str]) -> dict[str, str]:
    """``--oracle-logs``: ``PATH`` (one market only) or ``market=PATH[,market=PATH]``.

    Logs belong to one market (its tools, its observations): a synthetic run's logs would give
    StableToolBench's oracles a world model of tools it does not have, so with several markets
    each path must say whose it is; a market without logs collects its own.
    """
    if not value:
        return {}
    if "=" not in value:
        if len(markets) != 1:
            raise UsageError(f"--oracle-logs {value!r} with several markets ({','.join(markets)}): say which market's "
                             f"logs they are, e.g. --oracle-logs {markets[0]}={value} (ORACLE_LOGS in "
                             "scripts/bench_llm.sh); a market without logs collects its own")
        return {markets[0]: value}
    out: dict[str, str] = {}
    for part in (p.strip() for p in value.split(",") if p.strip()):
        market, sep, path = part.partition("=")
        market, path = market.strip(), path.strip()
        if not sep or not path or market not in markets:
            raise UsageError(f"--oracle-logs: {part!r} is not MARKET=PATH for one of --markets {','.join(markets)}")
        out[market] = path
    return out


def main(argv: list[str] | None = None) -> int:
    from eval.runner import DEFAULT_MAX_TURNS

    ap = argparse.ArgumentParser(prog="python -m eval.agents.llm_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="the OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True, help="served model name (GET /models)")
    ap.add_argument("--markets", default="synthetic,stabletoolbench")
    ap.add_argument("--methods", default="raw,prompt,tracker,intent")
    ap.add_argument("--tasks", type=int, default=10, help="synthetic tasks (default 10)")
    ap.add_argument("--stb-tasks", type=int, default=5, help="StableToolBench queries (default 5)")
    ap.add_argument("--oracle-tasks", type=int, default=10,
                    help="tasks the Prompt agent runs to collect INTENT/MCO/BTP's oracle logs (default 10)")
    ap.add_argument("--solvability", action="store_true",
                    help="StableToolBench: run the exhaustive DFSDT search for OR (hours with a real model)")
    ap.add_argument("--stb-path", default=None)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--max-turns", type=int, default=DEFAULT_MAX_TURNS,
                    help="model calls per episode before it ends without an answer (LangChain's "
                         "ModelCallLimitMiddleware; default 30: a 0.5B model looped for 35 turns on an invented tool)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds one agent request may take (default 600: on a CPU a 512-token reply to a long "
                         "history took over 120 s while other jobs shared the cores)")
    ap.add_argument("--feedback-chars", type=int, default=1500,
                    help="characters of refusal notes the agent reads per turn; older turns' notes are shortened "
                         "(BudgetGuard(feedback_chars=...); default 1500: a 0.5B model's 8,192-token context "
                         "overflowed on 15,448 characters of refusal notes in one turn)")
    ap.add_argument("--max-depth", type=int, default=None,
                    help="model turns in each INTENT/MCO rollout (default 8, the paper's horizon). Each turn is one "
                         "reply of the agent's model: on a CPU, 3 took a 0.5B model's median synthetic decision from "
                         "44 s to 34 s (README); the table says so")
    ap.add_argument("--rollout-max-tokens", type=int, default=160,
                    help="cap on each reply INTENT's and MCO's rollouts ask of the agent's model (default 160; 0: "
                         "the agent's --max-tokens). A 0.5B model on a CPU wrote 300-400 tokens per reply, ~40 s, "
                         "so a decision took minutes; a rollout needs the next calls, not the whole reply")
    ap.add_argument("--oracle-logs", default=None,
                    help="reuse oracle logs of an earlier run instead of running the Prompt agent on --oracle-tasks "
                         "first: PATH with one market, or MARKET=PATH[,MARKET=PATH] (e.g. "
                         "synthetic=OUT/synthetic/oracle_data/logs.jsonl)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench-llm")
    ap.add_argument("--parse-log", default=os.environ.get("INTENT_TOOL_PARSE_LOG"),
                    help="the lenient parser's log (default $INTENT_TOOL_PARSE_LOG)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--allow-code-change", action="store_true",
                    help="resume OUT/<market> though other code wrote its episodes (see intent bench)")
    args = ap.parse_args(argv)
    from eval.agents.chat import check_model, check_rollout_max_tokens

    # The runner checks it too, but only after the server has been reached (make bench-llm: after its cold
    # start); a bad flag should cost nothing. 0 is documented: no cap of its own.
    check_rollout_max_tokens(args.rollout_max_tokens if args.rollout_max_tokens != 0 else None)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    markets = [m.strip() for m in args.markets.split(",") if m.strip()]
    args.oracle_logs_by_market = oracle_logs_by_market(args.oracle_logs, markets)
    if not args.request_timeout > 0:
        raise UsageError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    check_model(args.base_url, args.model, flag="--model ", max_tokens=args.max_tokens)
    for market in markets:
        run_market(market, args, methods)
    return 0


if __name__ == "__main__":
    import sys

    try:
        raise SystemExit(main())
    except (IntentError, FileNotFoundError) as exc:  # EndpointError and the runner's config errors: one line
        print(f"llm_bench: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
