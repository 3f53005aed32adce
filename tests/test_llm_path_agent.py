"""The real-LLM path's agent-side errors, --max-tokens and `intent probe`, against a stdlib stub server.

The stub is an OpenAI-compatible HTTP server in a thread (GET /v1/models, POST /v1/chat/completions);
the end-to-end run against vLLM is `make bench-llm`, not a unit test.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from intent.cli import main

STUB_MODEL = "stub-model"
FENCED = '```json\n{"name": "%s", "arguments": {"symbol": "ACME"}}\n```'


class _Stub(BaseHTTPRequestHandler):
    mode = "tool_calls"  # tool_calls | fenced | bad_args | plain | no_tool_choice
    fail_next = 0  # answer this many chat requests with HTTP 400
    requests: list[dict] = []

    def log_message(self, *args):  # keep the test output clean
        pass

    def _send(self, payload, code=200):
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            self._send({"object": "list", "data": [{"id": STUB_MODEL, "object": "model", "max_model_len": 4096}]})
        else:
            self._send({"error": {"message": "not found"}}, 404)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(req)
        if req.get("model") != STUB_MODEL:
            return self._send({"error": {"message": f"The model `{req.get('model')}` does not exist."}}, 404)
        mode = type(self).mode
        if type(self).fail_next > 0:  # a server error the client does not retry: the episode crashes
            type(self).fail_next -= 1
            return self._send({"error": {"message": "stub: bad request"}}, 400)
        if mode == "no_tool_choice":
            return self._send({"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice and '
                                                    "--tool-call-parser to be set"}}, 400)
        answered = any(m.get("role") == "tool" for m in req["messages"])
        fn = req["tools"][0]["function"] if req.get("tools") else None
        message: dict = {"role": "assistant", "content": "Here is the answer."}
        if fn and not answered:
            if mode == "tool_calls":
                args = json.dumps({k: "x" for k in fn["parameters"].get("required", [])})
                message = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": fn["name"], "arguments": args}}]}
            elif mode == "bad_args":
                message = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "no_such_tool", "arguments": "{x"}}]}
            elif mode == "fenced":
                message = {"role": "assistant", "content": FENCED % fn["name"]}
        self._send({"id": "c1", "object": "chat.completion", "created": 0, "model": STUB_MODEL,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})


@pytest.fixture
def stub():
    _Stub.mode, _Stub.requests, _Stub.fail_next = "tool_calls", [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _dead_url() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    port = server.server_address[1]
    server.server_close()  # nothing listens there any more
    return f"http://127.0.0.1:{port}/v1"


def _one_line_error(capsys, *needles):
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert "| method |" not in captured.out  # no table
    return err


# -- agent-side errors before any episode -------------------------------------------------------------

def test_wrong_model_name_is_a_one_line_error_not_a_table(stub, tmp_path, capsys):
    code = main(["bench", "--agent", "openai:no-such-model", "--base-url", stub, "--methods", "raw", "--tasks", "1",
                 "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2
    _one_line_error(capsys, "'no-such-model' is not served", STUB_MODEL, "--agent openai:")
    assert _Stub.requests == []  # no episode ran
    assert not (tmp_path / "o" / "results.json").exists()


def test_unreachable_endpoint_is_a_one_line_error(tmp_path, capsys):
    code = main(["bench", "--agent", f"openai:{STUB_MODEL}", "--base-url", _dead_url(), "--methods", "raw",
                 "--tasks", "1", "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2
    _one_line_error(capsys, "cannot reach", "--base-url")


def test_no_base_url_and_no_api_key_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    code = main(["bench", "--agent", "openai:gpt-4.1-mini", "--methods", "raw", "--tasks", "1",
                 "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2
    _one_line_error(capsys, "OPENAI_API_KEY", "--base-url")


def test_max_tokens_reaches_every_request_and_defaults_to_512(stub, tmp_path):
    assert main(["bench", "--agent", f"openai:{STUB_MODEL}", "--base-url", stub, "--methods", "tracker",
                 "--tasks", "1", "--max-tokens", "77", "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    sent = [r.get("max_completion_tokens", r.get("max_tokens")) for r in _Stub.requests]
    assert sent and set(sent) == {77}
    _Stub.requests.clear()
    assert main(["bench", "--agent", f"openai:{STUB_MODEL}", "--base-url", stub, "--methods", "tracker",
                 "--tasks", "1", "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert {r.get("max_completion_tokens", r.get("max_tokens")) for r in _Stub.requests} == {512}


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_max_tokens_must_be_a_positive_integer(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--agent", "openai:x", "--max-tokens", value])
    assert exc.value.code == 2 and "--max-tokens" in capsys.readouterr().err


# -- intent probe --------------------------------------------------------------------------------------

def test_probe_counts_well_formed_tool_calls(stub, capsys, tmp_path):
    assert main(["probe", "--base-url", stub, "--model", STUB_MODEL, "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "well-formed tool calls: 4/4 (100%)" in out
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["rate"] == 1.0 and all(r["outcome"] == "tool_call" for r in report["results"])
    assert all(r["tools"] and r["tool_choice"] == "auto" for r in _Stub.requests)


def test_probe_spots_calls_written_as_text_and_fails_below_min_rate(stub, capsys):
    _Stub.mode = "fenced"
    assert main(["probe", "--base-url", stub, "--model", STUB_MODEL]) == 1
    captured = capsys.readouterr()
    assert "well-formed tool calls: 0/4 (0%)" in captured.out
    assert "--tool-parser-plugin intent_vllm/vllm_plugin.py" in captured.out
    assert captured.out.count("text_call") == 4 and "below --min-rate" in captured.err


def test_probe_counts_unknown_tools_and_bad_arguments_as_malformed(stub, capsys):
    _Stub.mode = "bad_args"
    assert main(["probe", "--base-url", stub, "--model", STUB_MODEL, "--min-rate", "0"]) == 0
    assert capsys.readouterr().out.count("malformed") == 4


def test_probe_refuses_a_timeout_that_is_not_a_number_of_seconds_above_0(capsys):
    # Was: --timeout 0 (or -5) taken, every probe then timing out at once and counted as no tool call.
    for timeout in ("0", "-5", "nan"):
        with pytest.raises(SystemExit) as exit_:
            main(["probe", "--base-url", "http://127.0.0.1:9/v1", "--model", STUB_MODEL, "--timeout", timeout])
        assert exit_.value.code == 2 and "argument --timeout: must be a number > 0" in capsys.readouterr().err


def test_probe_plain_answers_are_no_calls(stub, capsys):
    _Stub.mode = "plain"
    assert main(["probe", "--base-url", stub, "--model", STUB_MODEL]) == 1
    assert capsys.readouterr().out.count("no_call") == 4


def test_probe_unknown_model_is_a_one_line_error(stub, capsys):
    assert main(["probe", "--base-url", stub, "--model", "nope"]) == 2
    _one_line_error(capsys, "'nope' is not served", STUB_MODEL, "--model")


def test_probe_unreachable_endpoint_is_a_one_line_error(capsys):
    assert main(["probe", "--base-url", _dead_url(), "--model", STUB_MODEL]) == 2
    _one_line_error(capsys, "cannot reach")


def test_probe_server_without_tool_calling_names_the_fix(stub, capsys):
    _Stub.mode = "no_tool_choice"
    assert main(["probe", "--base-url", stub, "--model", STUB_MODEL]) == 2
    _one_line_error(capsys, "HTTP 400", "--enable-auto-tool-choice", "intent_lenient")


# -- rollout replies capped (--rollout-max-tokens) ----------------------------------------------------

def test_rollout_policy_replies_are_capped_and_the_agents_are_not(stub):
    # A 0.5B model on a CPU wrote 300-400 tokens per reply; a rollout needs only the next calls.
    from types import SimpleNamespace

    from langchain_core.messages import HumanMessage

    from eval.agents.chat import chat_agent_factory
    from eval.method_spec import MethodContext
    from eval.oracle_methods import _policy

    agent = chat_agent_factory(f"openai:{STUB_MODEL}", {"base_url": stub})(None, 0)
    env = SimpleNamespace(tools=[])
    policy = _policy(MethodContext(env=env, seed=0, options={"rollout_max_tokens": 48}, model=agent))
    policy.next_action([HumanMessage("hi")])
    agent.invoke([HumanMessage("hi")])
    sent = [r.get("max_completion_tokens", r.get("max_tokens")) for r in _Stub.requests]
    assert sent == [48, 512]
    assert policy.replies_capped  # its replies stop earlier than the agent's
    _Stub.requests.clear()
    uncapped = _policy(MethodContext(env=env, seed=0, options={}, model=agent))
    uncapped.next_action([HumanMessage("hi")])
    assert [r.get("max_completion_tokens", r.get("max_tokens")) for r in _Stub.requests] == [512]
    at_own = _policy(MethodContext(env=env, seed=0, options={"rollout_max_tokens": 600}, model=agent))
    assert not uncapped.replies_capped and not at_own.replies_capped  # cut where the agent is cut


def test_rollout_max_tokens_on_a_model_without_the_setting_names_the_flag():
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel

    from eval.agents.chat import with_reply_cap

    with pytest.raises(ValueError, match="--rollout-max-tokens.*GenericFakeChatModel"):
        with_reply_cap(GenericFakeChatModel(messages=iter([])), 64)


@pytest.mark.parametrize("value", ["4", "0"])
def test_rollout_max_tokens_is_checked_before_any_episode(stub, tmp_path, capsys, value):
    code = main(["bench", "--agent", f"openai:{STUB_MODEL}", "--base-url", stub, "--methods", "tracker,mco",
                 "--tasks", "1", "--rollout-max-tokens", value, "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2
    _one_line_error(capsys, "--rollout-max-tokens", ">= 16")
    assert _Stub.requests == []


def test_rollout_max_tokens_with_a_simulated_agent_is_refused_before_anything_runs(tmp_path, capsys):
    code = main(["bench", "--agent", "sim", "--methods", "raw,mco", "--tasks", "1", "--rollout-max-tokens", "64",
                 "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2
    _one_line_error(capsys, "--rollout-max-tokens", "'sim' agent", "--agent openai:NAME")
    assert not (tmp_path / "o" / "episodes.jsonl").exists() and not (tmp_path / "o" / "oracle_data").exists()


def test_the_rollout_cap_never_exceeds_the_agents_own(stub):
    from eval.agents.chat import chat_agent_factory, with_reply_cap

    agent = chat_agent_factory(f"openai:{STUB_MODEL}", {"base_url": stub, "max_tokens": 40})(None, 0)
    assert with_reply_cap(agent, 160).max_tokens == 40 and with_reply_cap(agent, 24).max_tokens == 24


def test_a_run_directory_refuses_another_rollout_cap(stub, tmp_path, capsys):
    # Resuming with another cap would mix episodes of two configurations in one table.
    # (mco: the cap is for rollouts, and a run without a planning oracle refuses it; a short, small one)
    args = ["bench", "--agent", f"openai:{STUB_MODEL}", "--base-url", stub, "--methods", "mco", "--tasks", "1",
            "--oracle-tasks", "1", "--max-depth", "1", "--out", str(tmp_path / "o"), "--no-progress"]
    assert main([*args, "--rollout-max-tokens", "64"]) == 0
    capsys.readouterr()
    assert main([*args, "--rollout-max-tokens", "96"]) == 2
    _one_line_error(capsys, "another configuration", "rollout_max_tokens")


def test_the_study_passes_the_llm_options_to_every_run(monkeypatch, tmp_path):
    # `intent bench study --rollout-max-tokens N` used to be accepted and then ignored.
    import eval.study

    seen = {}

    class Stop(Exception):
        pass

    def fake_run_study(cfg):
        seen.update(cfg.options)
        raise Stop

    monkeypatch.setattr(eval.study, "run_study", fake_run_study)
    with pytest.raises(Stop):
        main(["bench", "study", "--quick", "--agent", f"openai:{STUB_MODEL}", "--base-url", "http://x.invalid/v1",
              "--rollout-max-tokens", "64", "--feedback-chars", "900", "--max-tokens", "128", "--max-turns", "12",
              "--max-depth", "3", "--out", str(tmp_path / "s"), "--no-progress"])
    assert (seen["rollout_max_tokens"], seen["feedback_chars"], seen["max_tokens"], seen["max_turns"],
            seen["max_depth"]) == (64, 900, 128, 12, 3)


@pytest.mark.slow
@pytest.mark.parametrize("market", ["synthetic", "stabletoolbench"])
def test_bench_llm_runs_each_market_with_intent_end_to_end(stub, tmp_path, capsys, market):
    """The whole llm_bench path (probe aside) with an OpenAI-compatible agent: a market, a planning
    oracle whose logs are collected first (cross-fitted on StableToolBench), the table and the LLM
    stats. vLLM runs it in `make bench-llm`."""
    from eval.agents.llm_bench import main as llm_bench

    if market == "stabletoolbench":
        from eval.stabletoolbench.loader import StbDataError, resolve_root

        try:
            resolve_root()
        except StbDataError as exc:
            pytest.skip(f"StableToolBench data not available: {exc}")
    out = tmp_path / "run"
    assert llm_bench(["--base-url", stub, "--model", STUB_MODEL, "--markets", market,
                      "--methods", "raw,tracker,intent", "--tasks", "2", "--stb-tasks", "2", "--oracle-tasks", "2",
                      "--max-depth", "2", "--workers", "1", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("LLM path (stub-model, 2 tasks") == 1 and "rollouts <= 2 turns" in printed
    stats = json.loads((out / market / "llm_stats.json").read_text())
    assert stats["max_depth"] == 2 and set(stats["methods"]) == {"raw", "tracker", "intent"}
    for method, row in stats["methods"].items():
        assert row["episodes"] == 2 and row["errors"] == [], (market, method, row)
    assert stats["methods"]["intent"]["oracle_tokens_per_episode"] > 0  # the rollouts asked the model
    summary = json.loads((out / market / "results.json").read_text())
    assert summary["methods"]["tracker"]["FR"] == summary["methods"]["intent"]["FR"] == 100.0  # the gated ones
    assert summary["config"]["rollout_depth"] == 2  # in the run's options (test_rollout_depth: the oracles use it)
    assert (out / market / "oracle_data" / "COMPLETE").exists()


@pytest.mark.slow
def test_a_crashed_episode_is_listed_once_and_its_rerun_on_resume_gets_fresh_figures(stub, tmp_path, capsys):
    """The table after a method's run lists a crashed episode instead of quietly running it again;
    a resumed run re-runs it, and its server figures are this run's, not the saved ones."""
    from eval.agents.llm_bench import main as llm_bench
    from eval.results import ResultStore

    out = tmp_path / "run"
    argv = ["--base-url", stub, "--model", STUB_MODEL, "--markets", "synthetic", "--methods", "raw", "--tasks", "2",
            "--workers", "1", "--out", str(out), "--no-progress"]
    _Stub.fail_next = 1
    assert llm_bench(argv) == 0
    rows = ResultStore(out / "synthetic" / "episodes.jsonl").load(repair=False)
    assert len(rows) == 2 and sum(bool(r.error) for r in rows) == 1  # listed, not run again for the table
    first = json.loads((out / "synthetic" / "llm_stats.json").read_text())["methods"]["raw"]
    assert first["crashed"] == 1
    stats_path = out / "synthetic" / "llm_stats.json"
    saved = json.loads(stats_path.read_text())
    saved["methods"]["raw"]["run_seconds"] = -1.0  # a marker: the resumed run must not report it
    stats_path.write_text(json.dumps(saved))
    assert llm_bench(argv) == 0
    rows = ResultStore(out / "synthetic" / "episodes.jsonl").load(repair=False)
    assert len(rows) == 3  # the crashed episode ran again, the finished one did not
    again = json.loads(stats_path.read_text())["methods"]["raw"]
    assert again["crashed"] == 0 and again["run_seconds"] >= 0
    # tokens per second of this run: the re-run episode's tokens only, not the finished one's as well
    assert again["run_agent_tokens"] == rows[-1].agent_tokens > 0
    assert again["agent_tokens"] == sum(r.agent_tokens for r in rows if not r.error) > again["run_agent_tokens"]


def test_a_reply_cap_the_served_context_cannot_hold_is_a_one_line_error(stub, tmp_path, capsys):
    """vLLM lists each model's max_model_len: a --max-tokens at or above it would leave no room for
    a prompt, and every episode would end at its first call."""
    from eval.agents.chat import EndpointError
    from eval.agents.llm_bench import main as llm_bench

    code = main(["bench", "--agent", f"openai:{STUB_MODEL}", "--base-url", stub, "--methods", "raw", "--tasks", "1",
                 "--max-tokens", "4096", "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2
    _one_line_error(capsys, "--max-tokens 4096", "4096 tokens (max_model_len)")
    with pytest.raises(EndpointError, match="--max-tokens 4096 leaves no room"):
        llm_bench(["--base-url", stub, "--model", STUB_MODEL, "--markets", "synthetic", "--methods", "raw",
                   "--tasks", "1", "--max-tokens", "4096", "--out", str(tmp_path / "run"), "--no-progress"])
    assert _Stub.requests == []  # no episode ran
    # 4095 leaves room for a one-token prompt: the check passes it on to the server
    assert main(["bench", "--agent", f"openai:{STUB_MODEL}", "--base-url", stub, "--methods", "raw", "--tasks", "1",
                 "--max-tokens", "4095", "--out", str(tmp_path / "p"), "--no-progress"]) == 0


def test_the_study_refuses_the_flags_of_one_comparison(tmp_path, capsys, monkeypatch):
    # `intent bench study --tasks 5` used to run the whole study, the flag silently ignored.
    import eval.study

    monkeypatch.setattr(eval.study, "run_study", lambda cfg: pytest.fail("the study ran"))
    assert main(["bench", "study", "--quick", "--tasks", "5", "--methods", "raw", "--out", str(tmp_path / "s")]) == 2
    _one_line_error(capsys, "--tasks", "--methods", "not the study")
