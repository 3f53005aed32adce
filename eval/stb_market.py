"""Cost-augmented StableToolBench as a benchmark market (the INTENT paper's protocol).

* the 765 solvable test queries (``--stb-path``, default ``../shared/stabletoolbench``; never copied);
* 20 APIs retrieved per query from the pool of all 2,479 APIs (TF-IDF by default, MiniLM with
  ``retriever="minilm"``); recall@20 of the relevant APIs is reported (``OUT/retrieval.json``);
* integer prices U{5..50} from the seed, written to ``OUT/prices.json``; budget 50;
* tool environment: ``schema`` (simulated from ``template_response``, deterministic),
  ``mirror`` (a MirrorAPI-style model behind ``stb_env_url``) or ``server`` (a running
  StableToolBench server at ``stb_env_url``); every result says which environment produced it;
* judge: the deterministic **proxy** pass rate (an answer is given and every relevant API
  returned a success), reported as "proxy", never as SoPR.

The simulated agent infers what it needs from the query text alone (:mod:`eval.stabletoolbench.needs`:
retrieval scores between the query's clauses and its retrieved APIs); the answer key
(``relevant APIs``) is read only by the judge, the recall report and the price-robustness
study. Its need recall against the answer key is in ``OUT/retrieval.json``. It succeeds on a
result whose ``error`` is empty.

OR's denominator comes from ``OUT/solvability.json`` when an exhaustive DFSDT search was run
for this configuration (:mod:`eval.stabletoolbench.solvability` runs it; :func:`load_solvable` here reads
its verdicts, keyed by :func:`market_key`); otherwise ``solvable`` is None and OR is not reported.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain_core.tools import StructuredTool

from eval.agents.simulated import NeedView, TaskView
from eval.judges import SCORES
from eval.markets import EpisodeEnv
from intent.errors import UsageError
from intent.logs import label_of
from intent.market import Market, PricedTool

__all__ = ["SOLVABILITY_FILE", "StableToolBenchMarket", "load_solvable", "market_key", "market_key_json"]

BUDGET = 50.0
SOLVABILITY_FILE = "solvability.json"
_TYPE = {"integer": "integer", "string": "string", "boolean": "boolean", "number": "number"}


class StableToolBenchMarket:
    name = "stabletoolbench"

    def __init__(self, *, root: str | None = None, groups: Sequence[str] | None = None, limit: int | None = None,
                 seed: int = 0, out: str | Path = "runs/stb", retriever: str = "tfidf", environment: str = "schema",
                 env_url: str | None = None, env_model: str | None = None, budget: float = BUDGET,
                 relevant_price_scale: float = 1.0, budget_scale: float = 1.0, progress: bool = False,
                 sopr: Any = None) -> None:
        from eval.stabletoolbench import (
            PROXY_LABEL,
            api_pool,
            assign_prices,
            load_queries,
            price_meta,
            retrieve,
            write_prices,
        )
        from eval.stabletoolbench.needs import NeedInference, need_recall, summarize

        if environment in ("mirror", "server") and not env_url:
            raise UsageError(f"--stb-env {environment} needs --stb-env-url (the endpoint to call)")
        if environment not in ("schema", "mirror", "server"):
            raise UsageError(f"unknown StableToolBench environment {environment!r}; choose schema, mirror or server")
        if environment == "mirror":  # fail at startup: before the retrieval, OUT's files, and an hour of episodes
            from worldmodel.endpoints import check_endpoint, check_model

            if env_model:
                check_model(str(env_url), str(env_model), flag="--stb-env-model ", url_flag="--stb-env-url")
            else:
                check_endpoint(str(env_url), url_flag="--stb-env-url")
        elif environment == "server":
            _check_reachable(str(env_url))
        queries = load_queries(root, groups)
        if limit is not None and limit < len(queries):
            queries = _spread(queries, limit)
        self.queries = queries
        self.pool = api_pool(load_queries(root))  # the pool is always all 2,479 APIs
        embedder = self._embedder(retriever)
        self.retrieval = retrieve(queries, self.pool, embedder, k=20, progress=progress)
        # The agent's needs, from the query text and the retrieved APIs only (never the answer key).
        self.need_inference = NeedInference(embedder)
        inferred = self.need_inference.infer_many([(q.query, self.retrieval.retrieved_apis[q.query_id])
                                                   for q in queries])
        self.needs = {q.query_id: needs for q, needs in zip(queries, inferred)}
        # Reporting only: how well those needs match the answer key.
        per_query = {str(q.query_id): need_recall((n.api.function_name for n in self.needs[q.query_id]),
                                                  q.relevant_function_names) for q in queries}
        needs_report = summarize(per_query, {str(q.query_id): q.group for q in queries})
        self.need_recall = needs_report["need_recall"]
        prices = assign_prices(self.pool, seed)
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        # The budget the episodes run with (scaled), as given: int() recorded --budget 12.5 as 12.
        write_prices(out / "prices.json", prices, price_meta(seed, budget=budget * budget_scale))
        report = {k: v for k, v in self.retrieval.to_dict().items() if k != "retrieved"}
        report["agent_needs"] = {
            "label": "needs inferred by the simulated agent from the query text (scored against the answer key "
                     "here only)", "min_score": self.need_inference.min_score,
            "query_weight": self.need_inference.query_weight, **needs_report,
            "per_query": {qid: {"recall": r, "precision": p} for qid, (r, p) in per_query.items()}}
        (out / "retrieval.json").write_text(json.dumps(report, indent=2))
        self.prices = prices
        self.seed, self.retriever = seed, retriever
        self.sopr = sopr  # an eval.judges.SoPRJudge, or None for the proxy judge
        self.budget = budget * budget_scale
        self.relevant_price_scale = relevant_price_scale
        self.environment_kind = environment
        self.env_url, self.env_model = env_url, env_model
        self.need_inference_label = (
            f"agent's needs inferred from the query text by {embedder_name(retriever)} scores against the retrieved "
            f"APIs (need recall {self.need_recall:.3f} of the answer key, which only the judge reads)")
        # OR's denominator, when an exhaustive search was run for exactly this configuration.
        self.solvable_table: dict[str, bool] = load_solvable(out, self)
        self.label = (f"cost-augmented StableToolBench ({len(queries)} queries, 20 retrieved APIs by {embedder_name(retriever)}"
                      f" with recall@20 {self.retrieval.recall_at_k:.3f}, prices U{{5..50}} seed {seed}, budget "
                      f"{self.budget:g}; {environment}-environment responses"
                      + (" (simulated)" if environment == "schema" else "")
                      + f"; {sopr.label if sopr else PROXY_LABEL})")

    @staticmethod
    def _embedder(kind: str) -> Any:
        from eval.stabletoolbench import MiniLMEmbedder, TfidfEmbedder

        if kind == "tfidf":
            return TfidfEmbedder()
        if kind == "minilm":
            return MiniLMEmbedder()
        raise UsageError(f"unknown retriever {kind!r}; choose tfidf or minilm")

    @classmethod
    def from_config(cls, config: Any) -> StableToolBenchMarket:
        o = config.options
        sopr = None
        if o.get("judge") == "sopr":
            from eval.judges import SoPRJudge

            if not o.get("judge_url"):
                raise UsageError("--judge sopr needs --judge-url (an OpenAI-compatible endpoint) and --judge-model")
            sopr = SoPRJudge(o["judge_url"], o.get("judge_model", "gpt-4.1-mini"), runs=int(o.get("judge_runs", 3)))
        return cls(sopr=sopr, root=o.get("stb_path"), groups=o.get("groups"), limit=config.tasks, seed=config.seed,
                   out=config.out, retriever=o.get("retriever", "tfidf"), environment=o.get("stb_env", "schema"),
                   env_url=o.get("stb_env_url"), env_model=o.get("stb_env_model"),
                   budget=float(config.budget or BUDGET), budget_scale=config.budget_scale,
                   relevant_price_scale=config.relevant_price_scale)

    def tasks(self) -> Sequence[Any]:
        return self.queries

    def task_id(self, task: Any) -> str:
        return f"{task.group}:{task.query_id}"

    def _environment(self, apis: Sequence[Any]) -> Any:
        from eval.stabletoolbench import OpenAICompatibleSimulator, SchemaSimulator, ServerEnvironment

        if self.environment_kind == "schema":
            return SchemaSimulator(apis)
        if self.environment_kind == "mirror":
            return OpenAICompatibleSimulator(apis, self.env_url, self.env_model or "mirrorapi")
        return ServerEnvironment(self.env_url, apis)

    def episode(self, task: Any, seed: int) -> EpisodeEnv:
        from eval.stabletoolbench import openai_tool_schema

        apis = list(self.retrieval.retrieved_apis[task.query_id])
        env = self._environment(apis)
        relevant = set(task.relevant_function_names)
        scale = self.relevant_price_scale
        market = Market([PricedTool(a.function_name, max(1, round(self.prices[a.function_name] * scale))
                                    if a.function_name in relevant else self.prices[a.function_name],
                                    a.description[:200]) for a in _unique(apis)])
        successes: set[str] = set()
        details: list[dict[str, Any]] = []  # (name, arguments, response) of every executed call, for SoPR
        failures: list[str] = []  # the simulator's endpoint failed (EpisodeEnv.environment_failures)
        lock = threading.Lock()
        # The MirrorAPI-style simulator's client codes 5 (timeout) and 12 (HTTP error / not JSON) mean its
        # model endpoint failed: no response was simulated. Without this, a dead endpoint gave a normal-looking
        # table (every call an error observation, tracker FR 100%). A StableToolBench server's own error
        # answers stay observations, as upstream's client shows them to the agent.
        infra_codes = (5, 12) if self.environment_kind == "mirror" else ()

        def make_tool(api: Any) -> StructuredTool:
            fn = openai_tool_schema(api)["function"]
            params = fn["parameters"]
            schema = {"title": fn["name"], "type": "object",
                      "properties": {k: {"type": _TYPE.get(v.get("type"), "string"),
                                         "description": v.get("description", "")}
                                     for k, v in params.get("properties", {}).items()},
                      "required": list(params.get("required", []))}

            def run(**kwargs: Any) -> tuple[str, dict[str, Any]]:
                result = env.call(fn["name"], kwargs)
                with lock:
                    details.append({"name": fn["name"], "arguments": kwargs, "response": result.observation})
                    if result.ok:
                        successes.add(fn["name"])
                    if result.status_code in infra_codes:
                        failures.append(f"{fn['name']}: {result.error or result.observation[:120]}")
                return result.observation, {"z": int(result.ok), "status_code": result.status_code,
                                            "environment": result.environment}

            return StructuredTool.from_function(run, name=fn["name"], description=fn["description"][:1024],
                                                args_schema=schema, response_format="content_and_artifact")

        return EpisodeEnv(
            task_id=self.task_id(task), group=task.group, query=task.query, budget=self.budget, market=market,
            tools=[make_tool(a) for a in _unique(apis)], view=self.view(task, market),
            solvable=self.solvable_table.get(self.task_id(task)),
            judge=self._judge(task.query, relevant, successes, details),
            environment=getattr(env, "environment", self.environment_kind),
            schema_world_model=self._schema_world_model(apis), environment_failures=failures,
            judge_branch=lambda messages: self.branch_judge(task, messages),
        )

    def view(self, task: Any, market: Market) -> TaskView:
        """What the agent knows before it starts: the query and the needs inferred from it
        (computed in ``__init__`` from the query text and the retrieved APIs; no answer key)."""
        needs = []
        for i, need in enumerate(self.needs[task.query_id]):
            api = need.api
            args = {p.schema_name: (p.default if str(p.default) else _placeholder(p)) for p in api.required}
            providers = (api.function_name,) if api.function_name in market else ()
            needs.append(NeedView(f"n{i}", f"result of {api.api_name} ({api.tool_name})", args, providers))
        return TaskView(task_id=self.task_id(task), query=task.query, needs=tuple(needs),
                        covers={n.providers[0]: frozenset({n.id}) for n in needs if n.providers},
                        tiers={}, reading="envelope")

    def judge_path(self, task: Any, answer: str | None, messages: Sequence[Any]) -> float:
        """The episode's judge applied to one search branch: what its own calls returned.

        For OR's exhaustive search, where branches share an episode but not their evidence.
        """
        return self.branch_judge(task, messages)(answer)

    def branch_judge(self, task: Any, messages: Sequence[Any]) -> Any:
        """The judge of one search branch (:attr:`EpisodeEnv.judge_branch`): its own calls' evidence only."""
        from langchain_core.messages import AIMessage, ToolMessage

        names: dict[str, tuple[str, Any]] = {}
        successes: set[str] = set()
        details: list[dict[str, Any]] = []
        for m in messages:
            if isinstance(m, AIMessage):
                names.update({c["id"]: (c["name"], c.get("args", {})) for c in m.tool_calls})
            elif isinstance(m, ToolMessage) and m.tool_call_id in names:
                name, args = names[m.tool_call_id]
                artifact = m.artifact if isinstance(m.artifact, dict) else {}
                if "intent_reason" in artifact:
                    continue  # refused by the guard: never ran
                details.append({"name": name, "arguments": args, "response": str(m.content)})
                if label_of({"artifact": artifact}, ground_truth_only=True) == 1:
                    successes.add(name)
        return self._judge(task.query, set(task.relevant_function_names), successes, details)

    def _judge(self, query: str, relevant: set[str], successes: set[str], details: list[dict[str, Any]]) -> Any:
        from eval.stabletoolbench import proxy_pass

        if self.sopr is None:
            return lambda answer: float(proxy_pass(answer, relevant, successes))

        def sopr(answer: str | None) -> float:
            labels = self.sopr.judge(query, answer, details)
            sopr.runs = [SCORES[label] for label in labels]  # per-run scores: mean ± std over runs
            return sum(sopr.runs) / len(sopr.runs)

        return sopr

    def _schema_world_model(self, apis: Sequence[Any]) -> Any:
        from eval.stabletoolbench.schema_world_model import SchemaWorldModel

        # The environment's own simulator only when the episodes run against it (a leak, labelled).
        return SchemaWorldModel(apis, leaks=self.environment_kind == "schema")


def market_key(market: Any) -> dict[str, Any]:
    """Everything about a market that decides whether a query is solvable."""
    return {"budget": market.budget, "price_seed": market.seed, "relevant_price_scale": market.relevant_price_scale,
            "retriever": market.retriever, "environment": market.environment_kind,
            "environment_url": market.env_url, "environment_model": market.env_model,
            "judge": market.sopr.label if market.sopr else "proxy",
            "needs": {"min_score": market.need_inference.min_score,
                      "query_weight": market.need_inference.query_weight}}


def market_key_json(market: Any) -> str:
    """:func:`market_key` as the JSON text that keys ``OUT/solvability.json``'s searches."""
    return json.dumps(market_key(market), sort_keys=True)


def load_solvable(out: str | Path, market: Any) -> dict[str, bool]:
    """The verdicts ``OUT/solvability.json`` holds for this market's configuration (task id ->
    solvable); empty when no search was run for it."""
    path = Path(out) / SOLVABILITY_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        entry = data["searches"].get(market_key_json(market)) or {}
        return {tid: bool(r["solvable"]) for tid, r in (entry.get("tasks") or {}).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"{path} is not a solvability cache ({exc!r}); delete it and rerun the search") from exc


def _check_reachable(url: str, timeout: float = 5.0) -> None:
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if not parsed.hostname:
        raise UsageError(f"--stb-env-url {url!r} is not a URL like http://127.0.0.1:8080/virtual")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout).close()
    except OSError as exc:
        raise UsageError(f"cannot reach the StableToolBench server at {url}: {exc}; is it running?") from exc


def embedder_name(kind: str) -> str:
    return {"tfidf": "TF-IDF", "minilm": "MiniLM (all-MiniLM-L6-v2)"}.get(kind, kind)


def _unique(apis: Sequence[Any]) -> list[Any]:
    seen, out = set(), []
    for a in apis:
        if a.function_name not in seen:
            seen.add(a.function_name)
            out.append(a)
    return out


def _placeholder(param: Any) -> Any:
    t = str(param.type).upper()
    return 1 if t == "NUMBER" else True if t == "BOOLEAN" else "example"


def _spread(queries: Sequence[Any], limit: int) -> list[Any]:
    """A deterministic subset that keeps every group represented (every k-th query)."""
    step = len(queries) / limit
    return [queries[int(i * step)] for i in range(limit)]
