"""The benchmark harness: simulated agent behaviours, metrics, resume, CLI errors, HTTP agent."""

from __future__ import annotations

import json
from typing import Any
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

from eval.agents.simulated import NeedView, SimAgentConfig, SimulatedAgent, TaskView, looks_successful
from eval.metrics import compute_metrics, group_pass_rates
from eval.results import EpisodeResult, ResultStore, ResultsFormatError
from eval.runner import BenchConfig, run_benchmark, run_episode, sim_agent_factory
from eval.methods import get_method

NEED = NeedView("n0", "weather in Oslo", {"city": "Oslo"}, ("w_premium", "w_mid", "w_cheap"))
NEED2 = NeedView("n1", "quote of ACME", {"symbol": "ACME"}, ("q_premium", "q_cheap"))
VIEW = TaskView(
    "t0", "Weather in Oslo and ACME quote?", (NEED, NEED2),
    covers={"w_premium": frozenset({"n0"}), "w_mid": frozenset({"n0"}), "w_cheap": frozenset({"n0"}),
            "q_premium": frozenset({"n1"}), "q_cheap": frozenset({"n1"}), "bundle": frozenset({"n0", "n1"})},
    tiers={"w_premium": "premium", "w_mid": "mid", "w_cheap": "cheap", "q_premium": "premium", "q_cheap": "cheap",
           "bundle": "composite"},
)
PRICES = "You have a hard budget of 40 for tool calls.\nTool prices (cost per call):\n" + "\n".join(
    f"- {n}: {p}" for n, p in {"w_premium": 30, "w_mid": 12, "w_cheap": 5, "q_premium": 25, "q_cheap": 6,
                               "bundle": 20}.items())


def agent(**cfg) -> SimulatedAgent:
    base = dict(myopic_first=0.0, parallel=0.0, use_composites=0.0, arg_noise=0.0, respect_budget=1.0)
    base.update(cfg)
    return SimulatedAgent(view=VIEW, config=SimAgentConfig(**base), seed=1)


def first_call(model, messages):
    return model.invoke(messages).tool_calls


def test_success_reading():
    assert looks_successful(NEED, '{"city": "Oslo", "forecast": "rain"}')
    assert not looks_successful(NEED, '{"city": "Bergen", "forecast": "rain"}')  # irrelevant payload
    assert not looks_successful(NEED, "503 Service Unavailable")


def test_myopic_first_call_picks_premium_even_with_prices():
    calls = first_call(agent(myopic_first=1.0), [SystemMessage(PRICES), HumanMessage("q")])
    assert calls[0]["name"] == "w_premium"


def test_reads_prices_when_told_and_prefers_quality_when_not():
    told = first_call(agent(price_adherence=1.0), [SystemMessage(PRICES), HumanMessage("q")])
    assert told[0]["name"] == "w_cheap"
    blind = [first_call(SimulatedAgent(view=VIEW, seed=s, config=SimAgentConfig(myopic_first=0, parallel=0,
                                                                                use_composites=0)),
                        [HumanMessage("q")])[0]["name"] for s in range(60)]
    assert blind.count("w_premium") > blind.count("w_cheap")


def test_retry_loop_on_a_failing_tool_then_switch():
    model = agent(price_adherence=1.0, retry_limit=(2, 2))
    history = [SystemMessage(PRICES), HumanMessage("q")]
    names = []
    for step in range(4):
        ai = model.invoke(history)
        call = ai.tool_calls[0]
        names.append(call["name"])
        history += [ai, ToolMessage("503 Service Unavailable", tool_call_id=call["id"])]
    assert names[:3] == ["w_cheap"] * 3 and names[3] != "w_cheap"


def test_replans_on_guard_feedback():
    model = agent(price_adherence=0.0, blind_preference=(1.0, 0.0, 0.0), insist=0.0)
    history = [HumanMessage("q")]
    ai = model.invoke(history)
    assert ai.tool_calls[0]["name"] == "w_premium"
    feedback = ("Budget guard: the call to w_premium was not executed and cost nothing. It costs 30 but only "
                "10 of the budget 40 is left.")
    history += [ai, ToolMessage(feedback, tool_call_id=ai.tool_calls[0]["id"], status="error")]
    again = model.invoke(history)
    assert again.tool_calls and again.tool_calls[0]["name"] not in ("w_premium",)
    trace = ("Rejected. Predicted trace:\nstep | tool | price | p_success | expected_cost\n"
             "1 | w_mid | 12 | 0.20 | 60\n2 | q_cheap | 6 | 0.9 | 6.7\n")
    history2 = [HumanMessage("q"), ai, ToolMessage(trace, tool_call_id=ai.tool_calls[0]["id"], status="error")]
    third = model.invoke(history2)
    assert third.tool_calls[0]["name"] not in ("w_premium", "w_mid")  # low-p step avoided


def test_answers_when_needs_met_and_counts_tokens():
    model = agent()
    h = [HumanMessage("q")]
    a1 = model.invoke(h)
    h += [a1, ToolMessage('{"city": "Oslo", "t": 3}', tool_call_id=a1.tool_calls[0]["id"])]
    a2 = model.invoke(h)
    h += [a2, ToolMessage('{"symbol": "ACME", "price": 3}', tool_call_id=a2.tool_calls[0]["id"])]
    final = model.invoke(h)
    assert not final.tool_calls and "weather in Oslo" in final.content
    assert final.usage_metadata["total_tokens"] > 0


def test_parallel_proposals():
    calls = first_call(agent(parallel=1.0), [HumanMessage("q")])
    assert len(calls) == 2


def r(method, task, passed, cost, budget=50.0, solvable=True, calls=2, price_sum=None, wall=1.0, tokens=100, group="g"):
    return EpisodeResult(method=method, task_id=task, seed=0, passed=passed, cost=cost, budget=budget,
                         solvable=solvable, n_calls=calls, price_sum=cost if price_sum is None else price_sum,
                         wall_s=wall, agent_tokens=tokens, group=group, answered=True)


def test_metric_definitions_on_hand_made_episodes():
    rs = [
        r("raw", "a", 1.0, 60.0), r("raw", "b", 1.0, 20.0), r("raw", "c", 0.0, 10.0, solvable=False),
        r("prompt", "a", 1.0, 40.0, wall=2.0, tokens=300), r("prompt", "b", 0.5, 30.0, wall=2.0, tokens=300),
        r("prompt", "c", 0.0, 55.0, wall=2.0, tokens=300, solvable=False),
    ]
    m = compute_metrics(rs, reference="raw", e2e_seconds={"raw": 3.0, "prompt": 6.0})
    raw, pr = m["raw"], m["prompt"]
    assert raw["PR"] == pytest.approx(100 / 3, abs=0.01)  # a overspent: solved but infeasible
    assert raw["FR"] == pytest.approx(200 / 3, abs=0.01)
    assert raw["OR"] == 50.0  # 1 of the 2 solvable tasks
    assert pr["PR"] == 50.0 and pr["OR"] == 75.0  # Unsure counts 0.5
    assert pr["AC"] == pytest.approx(125 / 3, abs=1e-3) and pr["AP"] == pytest.approx(125 / 6, abs=1e-3)
    assert pr["WR"] == pytest.approx(100 / 3, abs=0.01)  # wins a (1 vs 0 feasible); b ties lose on score 0.5<1
    assert pr["time_ratio"] == 2.0 and pr["latency_ratio"] == 2.0 and pr["token_ratio"] == 3.0
    assert group_pass_rates(rs)["prompt"] == {"g": 50.0}


def test_result_store_resume_and_torn_tail(tmp_path):
    store = ResultStore(tmp_path / "episodes.jsonl")
    store.append(r("raw", "a", 1, 1))
    with open(store.path, "a") as fh:
        fh.write('{"method": "raw", "task_')  # a crash in the middle of a write
    assert [x.task_id for x in store.load()] == ["a"] and store.dropped_torn_tail
    store.append(r("raw", "b", 1, 1))
    assert [x.task_id for x in store.load()] == ["a", "b"]
    with open(store.path, "a") as fh:
        fh.write("garbage\n" + json.dumps({"schema": 1}) + "\n")
    with pytest.raises(ResultsFormatError, match="episodes.jsonl:3"):
        store.load()


def test_result_store_refuses_a_complete_bad_last_line(tmp_path):
    # A torn write never ends in its newline (append writes the line and it at once): a bad last line that
    # does is corruption. It was taken for torn and cut away by the next resume, a result lost unsaid.
    store = ResultStore(tmp_path / "episodes.jsonl")
    store.append(r("raw", "a", 1, 1))
    with open(store.path, "a") as fh:
        fh.write('{"method": "raw", "task_\n')
    before = store.path.read_bytes()
    with pytest.raises(ResultsFormatError, match="episodes.jsonl:2: corrupt line"):
        store.load()
    assert store.path.read_bytes() == before and not store.dropped_torn_tail


def test_a_complete_last_line_without_its_newline_is_closed_by_a_repairing_load(tmp_path):
    # A last line that is whole JSON but lost its "\n" (a file edited by hand, copied, or cut by a tool) was kept
    # by the load, and the next append joined a second result onto that line: the load after it failed, "Extra
    # data" on a line that held two results.
    store = ResultStore(tmp_path / "episodes.jsonl")
    store.append(r("raw", "a", 1, 1))
    store.path.write_text(store.path.read_text().rstrip("\n"))
    assert [x.task_id for x in store.load(repair=False)] == ["a"]
    assert not store.path.read_text().endswith("\n")  # a read-only load leaves the file as it is
    assert [x.task_id for x in store.load()] == ["a"] and not store.dropped_torn_tail
    assert store.path.read_text().endswith("\n")
    store.append(r("raw", "b", 1, 1))
    assert [x.task_id for x in ResultStore(store.path).load()] == ["a", "b"]


def test_interrupted_run_resumes_where_it_stopped(tmp_path):
    out = tmp_path / "run"
    cfg = BenchConfig(tasks=12, methods=["raw", "prompt"], out=str(out), workers=2, seed=3)
    calls = {"n": 0}
    real = sim_agent_factory()

    def crashing(env, seed):
        calls["n"] += 1
        if calls["n"] > 7:
            raise KeyboardInterrupt  # the run dies after 7 episodes
        return real(env, seed)

    with pytest.raises(KeyboardInterrupt):
        run_benchmark(cfg, agent_factory=crashing, progress=False)
    partial = ResultStore(out / "episodes.jsonl").load()
    assert 0 < len(partial) <= 7
    summary = run_benchmark(cfg, progress=False)
    final = ResultStore(out / "episodes.jsonl").load()
    assert len(final) == 24 and len({(x.method, x.task_id) for x in final}) == 24
    again = run_benchmark(cfg, progress=False)  # nothing left to do: same numbers
    for key in ("PR", "OR", "FR", "AC"):
        assert again["methods"]["prompt"][key] == summary["methods"]["prompt"][key]
    with pytest.raises(ValueError, match="another configuration"):
        run_benchmark(BenchConfig(tasks=13, methods=["raw"], out=str(out), reference="raw"), progress=False)


def test_each_bench_process_numbers_its_attempts_in_the_results_and_the_log(tmp_path):
    # Readers matched an episode's attempts in the log to its results by count, which fails when an attempt logs no
    # tool record (a crash at its first model call). Each process that runs episodes takes the next attempt number
    # (OUT/attempts.json) and marks its records and results with it; the numbers change no figure.
    from eval.compare import compare_methods
    from intent.logs import read_log

    out = tmp_path / "run"
    cfg = BenchConfig(tasks=4, methods=["raw", "prompt"], out=str(out), workers=2, seed=3, reference="raw")
    real = sim_agent_factory()
    crash_task = {}

    def crashing(env, seed):
        crash_task.setdefault("id", env.task_id)
        return object() if env.task_id == crash_task["id"] else real(env, seed)  # no model: its first call fails

    run_benchmark(cfg, agent_factory=crashing, progress=False)
    resumed = run_benchmark(cfg, progress=False)
    again = run_benchmark(cfg, progress=False)  # nothing left to run: takes no number
    assert json.loads((out / "attempts.json").read_text()) == {"last_attempt": 2}
    results = ResultStore(out / "episodes.jsonl").load()
    crashed = [r for r in results if r.error]
    assert crashed and all(r.extra["attempt"] == 1 and r.task_id == crash_task["id"] for r in crashed)
    reruns = [r for r in results if r.task_id == crash_task["id"] and not r.error]
    assert sorted(r.method for r in reruns) == ["prompt", "raw"] and {r.extra["attempt"] for r in reruns} == {2}
    assert {r.extra["attempt"] for r in results if r.task_id != crash_task["id"]} == {1}
    records = list(read_log(out / "logs.jsonl"))
    assert records and all(r.model_extra["attempt"] in (1, 2) for r in records)
    assert {r.model_extra["attempt"] for r in records if f":{crash_task['id']}:" in r.task_id} == {2}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # attempts selected by number: none is taken for unfinished
        compare_methods(out, "raw", "prompt")
    straight = run_benchmark(BenchConfig(tasks=4, methods=["raw", "prompt"], out=str(tmp_path / "straight"),
                                         workers=1, seed=3, reference="raw"), progress=False)
    for m in ("raw", "prompt"):
        for key in ("PR", "OR", "FR", "AC", "AP", "n"):
            assert resumed["methods"][m][key] == again["methods"][m][key] == straight["methods"][m][key]


# (--world-model schema is refused on the synthetic market before the directory is looked at:
# tests/test_bench_setup_timing.py)
@pytest.mark.parametrize("option,value", [("gamma", 5.0), ("delta", 0.9), ("predictor", "encoder"),
                                          ("oracle_fraction", 0.5), ("oracle_logs", "/elsewhere/logs.jsonl")])
def test_a_run_directory_refuses_results_made_with_another_option(tmp_path, option, value):
    # A rerun with --gamma 5 into the same --out printed the old INTENT numbers under the new settings.
    out = tmp_path / "run"
    run_benchmark(BenchConfig(tasks=2, methods=["raw"], out=str(out), reference="raw"), progress=False)
    with pytest.raises(ValueError, match=f"another configuration.*{option}"):
        run_benchmark(BenchConfig(tasks=2, methods=["raw"], out=str(out), reference="raw", options={option: value}),
                      progress=False)
    # The same value as the default is the same configuration; an option that only shapes the report is too.
    run_benchmark(BenchConfig(tasks=2, methods=["raw"], out=str(out), reference="raw",
                              options={"gamma": 0.5, "paired_with": ["raw"]}), progress=False)


@pytest.mark.slow
def test_same_seed_reproduces_the_table(tmp_path):
    methods = ["raw", "prompt", "tracker", "btp", "bats", "dfsdt", "mco", "intent", "intent-stochastic"]
    opts = {"oracle_train_tasks": 30}
    a = run_benchmark(BenchConfig(tasks=20, methods=methods, out=str(tmp_path / "a"), workers=2, options=opts),
                      progress=False)
    # One worker here, two above: the README says the same seed gives the same table with any --workers.
    b = run_benchmark(BenchConfig(tasks=20, methods=methods, out=str(tmp_path / "b"), workers=1, options=opts),
                      progress=False)
    for m in methods:
        for k in ("PR", "OR", "WR", "FR", "AC", "AP", "n"):
            assert a["methods"][m][k] == b["methods"][m][k]
    # The budgets bind in this run (the soft baseline overspends), so the equal FRs above compare
    # numbers that could differ; an enforcing method's FR = 100 is checked against what the tools
    # observed in test_baselines, not re-read from the guard's ledger here.
    assert a["methods"]["raw"]["FR"] < 100.0 and a["methods"]["raw"]["overspend_tasks"] > 0
    assert a["config"]["agent_label"].startswith("simulated")
    assert set(json.loads((tmp_path / "a" / "results.json").read_text())) == {"config", "methods", "groups", "paired",
                                                                                "paired_regret"}
    assert a["paired"] == b["paired"] and set(a["paired"]) == {"tracker", "prompt"}  # seeded bootstrap
    assert a["paired_regret"] == b["paired_regret"]


@pytest.mark.parametrize("bad,match", [
    (dict(methods=["nope"]), "unknown method 'nope'"),
    (dict(seed=-1), "--seed"),
    (dict(market="moon"), "unknown market"),
    (dict(reference="bats", methods=["raw"]), "--reference"),
])
def test_bad_configuration_is_named(tmp_path, bad, match):
    cfg = BenchConfig(tasks=2, out=str(tmp_path / "x"), **{"methods": ["raw", "prompt"], **bad})
    with pytest.raises(ValueError, match=match):
        run_benchmark(cfg, progress=False)


def test_unreachable_endpoint_fails_at_startup(tmp_path):
    from eval.agents.chat import EndpointError

    cfg = BenchConfig(tasks=2, methods=["raw", "prompt"], agent="openai:x", out=str(tmp_path / "y"),
                      options={"base_url": "http://127.0.0.1:9/v1"})
    with pytest.raises(EndpointError, match="cannot reach"):
        run_benchmark(cfg, progress=False)


class _StubOpenAI(BaseHTTPRequestHandler):
    """A tiny OpenAI-compatible chat server: first a tool call, then an answer."""

    def log_message(self, *args):  # keep test output clean
        pass

    def _send(self, payload):
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        has_tool_result = any(m.get("role") == "tool" for m in req["messages"])
        if has_tool_result or not req.get("tools"):
            message = {"role": "assistant", "content": "Here is the answer."}
        else:
            fn = req["tools"][0]["function"]
            args = {k: "x" for k in fn["parameters"].get("required", [])}
            message = {"role": "assistant", "content": "Calling a tool.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": fn["name"], "arguments": json.dumps(args)}}]}
        self._send({"id": "c1", "object": "chat.completion", "created": 0, "model": "stub",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})


def test_http_chat_model_drives_one_guarded_episode():
    from eval.agents.chat import chat_agent_factory
    from eval.markets import SyntheticBenchMarket

    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/v1"
        factory = chat_agent_factory("openai:stub", {"base_url": base, "api_key": "k"})
        market = SyntheticBenchMarket(1, 0)
        env = market.episode(market.tasks()[0], 0)
        result = run_episode(get_method("tracker"), env, 0, factory)
    finally:
        server.shutdown()
    assert not result.error, result.error
    assert result.answered and result.n_calls + result.n_rejected + result.n_invalid == 1
    assert result.agent_tokens == 30 and result.cost <= result.budget


def test_a_run_directory_accepts_a_resume_with_other_connection_settings_and_one_made_before_options_counted(
        tmp_path):
    # The request timeout or the server's port do not shape results (make bench-llm with a larger
    # REQUEST_TIMEOUT was refused); a directory written before every option was recorded resumes when what it
    # recorded agrees (a study started earlier could not be resumed).
    out = tmp_path / "run"
    cfg = BenchConfig(tasks=2, methods=["raw"], out=str(out), reference="raw", options={"timeout": 600})
    run_benchmark(cfg, progress=False)
    run_benchmark(BenchConfig(tasks=2, methods=["raw"], out=str(out), reference="raw",
                              options={"timeout": 900, "base_url": "http://127.0.0.1:8001/v1"}), progress=False)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "run_config.json").write_text(json.dumps(
        {"market": "synthetic", "agent": "sim", "tasks": 2, "seed": 0, "event_rate": 0.0, "budget": None,
         "budget_scale": 1.0, "relevant_price_scale": 1.0}))
    # (Its code was not recorded either: resumed only when allowed, tests/test_run_directory_code.py.)
    run_benchmark(BenchConfig(tasks=2, methods=["raw"], out=str(legacy), reference="raw",
                              options={"oracle_train_tasks": 6, "allow_code_change": True}), progress=False)
    assert json.loads((legacy / "run_config.json").read_text())["oracle_train_tasks"] == 6  # recorded from here on
    with pytest.raises(ValueError, match="another configuration"):
        run_benchmark(BenchConfig(tasks=2, methods=["raw"], out=str(legacy), reference="raw",
                                  options={"oracle_train_tasks": 7}), progress=False)


def test_a_resumed_run_keeps_the_world_models_label(tmp_path):
    # A rerun whose oracle episodes were all done built no oracle model and relabelled its world model
    # "replay of the oracle logs" (an upper bound on the environment's simulator would have been published
    # as the replay model).
    out = tmp_path / "run"
    cfg = BenchConfig(tasks=2, methods=["raw", "mco"], out=str(out), reference="raw",
                      options={"oracle_train_tasks": 6})
    first = run_benchmark(cfg, progress=False)["config"]["world_model"]
    assert first.startswith("world model = replay of logged observations")
    assert run_benchmark(cfg, progress=False)["config"]["world_model"] == first
    plain = BenchConfig(tasks=2, methods=["raw"], out=str(tmp_path / "plain"), reference="raw")
    assert run_benchmark(plain, progress=False)["config"]["world_model"] == "none (no method here uses one)"


def test_the_printed_header_and_results_md_name_the_world_model_and_the_oracle_notes(tmp_path, capsys):
    from intent.cli import main

    out = tmp_path / "run"
    assert main(["bench", "--tasks", "2", "--methods", "raw,mco", "--oracle-tasks", "6", "--no-progress",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "world model (MCO/INTENT): world model = replay of logged observations" in printed
    (out / "oracle_context.json").write_text('{"world_model": "wm", "notes": ["a note the models left"]}')
    assert main(["bench", "--tasks", "2", "--methods", "raw,mco", "--oracle-tasks", "6", "--no-progress",
                 "--out", str(out)]) == 0  # resumed: every episode done, the saved context is reported
    assert "oracle note: a note the models left" in capsys.readouterr().out
    assert "- oracle note: a note the models left" in (out / "results.md").read_text()


def test_oracle_options_are_checked_before_anything_runs(tmp_path):
    # Each was refused only after the oracle logs' collection (hours with a real model), or never: an empty
    # log or one of the other market's tools gave INTENT an empty replay without a word.
    def bench(**options: Any) -> None:
        run_benchmark(BenchConfig(tasks=2, methods=["raw", "intent"], out=str(tmp_path / "run"), reference="raw",
                                  options=options), agent_factory=_never, progress=False)

    with pytest.raises(ValueError, match="--gamma"):
        bench(gamma=-1.0)
    with pytest.raises(ValueError, match="--delta"):
        bench(delta=5.0)
    with pytest.raises(ValueError, match="--predictor-dir"):
        bench(predictor_dir=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="is a directory"):
        bench(oracle_logs=str(tmp_path))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no tool calls"):
        bench(oracle_logs=str(empty))
    other = tmp_path / "other.jsonl"
    from intent.logs import JsonlLogSink, StepRecord

    JsonlLogSink(other).write(StepRecord(task_id="t", step=0, call_id="c", tool="get_weather_on_mars", decision="accept",
                                         status="ok", budget=1.0, spent=0.0, remaining=1.0))
    with pytest.raises(ValueError, match="another market"):
        bench(oracle_logs=str(other))
    # An empty or base-model directory passed this check and failed (or loaded an untrained head) later.
    (tmp_path / "pred").mkdir()
    with pytest.raises(ValueError, match="no config.json or calibration.json"):
        bench(predictor_dir=str(tmp_path / "pred"))
    (tmp_path / "pred" / "config.json").write_text("{}")
    (tmp_path / "pred" / "calibration.json").write_text("{}")
    with pytest.raises(ValueError, match="would ignore --predictor-dir"):
        bench(predictor_dir=str(tmp_path / "pred"), predictor="encoder")
    # Logs of the evaluated tasks themselves (the run's own suggestion to reuse them, with its --seed): the models
    # would be built from the episodes they guard. Logs a benchmark collected on another market, by its marker.
    own = tmp_path / "own.jsonl"
    JsonlLogSink(own).write(StepRecord(task_id="prompt:syn-0-0001:10007", step=0, call_id="c", tool="x",
                                       decision="accept", status="ok", budget=1.0, spent=0.0, remaining=1.0))
    with pytest.raises(ValueError, match="evaluated task syn-0-0001"):
        bench(oracle_logs=str(own))
    collected = tmp_path / "v2run" / "oracle_data"
    collected.mkdir(parents=True)
    (collected / "logs.jsonl").write_text(other.read_text())
    (collected / "COMPLETE").write_text('{"market": "synthetic-v2", "seed": 10007, "tasks": 50}\n')
    with pytest.raises(ValueError, match="collected on --market synthetic-v2, not synthetic"):
        bench(oracle_logs=str(collected / "logs.jsonl"))


def _never(env: Any, seed: int) -> Any:
    raise AssertionError("no episode may run before the options are checked")


def test_ctrl_c_stops_a_benchmark_without_running_the_queued_episodes(tmp_path):
    # The pool ran every queued episode to the end before the KeyboardInterrupt got out (a whole run with a
    # real model); now the queued ones are dropped and the same command resumes.
    real = sim_agent_factory()
    calls = {"n": 0}
    lock = threading.Lock()

    def interrupted(env: Any, seed: int) -> Any:
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n == 4:  # (the first is the discarded warm-up episode)
            raise KeyboardInterrupt
        return real(env, seed)

    cfg = BenchConfig(tasks=30, methods=["raw"], workers=2, out=str(tmp_path / "run"), reference="raw")
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(cfg, agent_factory=interrupted, progress=False)
    assert calls["n"] <= 6, f"{calls['n']} episodes started after Ctrl-C"
    summary = run_benchmark(cfg, progress=False)  # resumed
    assert summary["methods"]["raw"]["n"] == 30
