"""The SoPR judge's rules against a local OpenAI-compatible stub, and SoPR in the benchmark."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eval.judges import SoPRJudge


class _Judge(BaseHTTPRequestHandler):
    asked: list[str] = []

    def log_message(self, *a):
        pass

    def _send(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"data": [{"id": "judge"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        name = body["tool_choice"]["function"]["name"]
        type(self).asked.append(name)
        prompt = body["messages"][0]["content"]
        status = ("Unsure" if "UNSURE" in prompt else "Solved") if name == "check_answer_status" else "Solved"
        if "BAD" in prompt:
            status = "Unsolved"
        if "NO CALL" in prompt:  # the judge model answers in prose: no forced call
            return self._send({"choices": [{"message": {"role": "assistant", "content": "Solved, I think"}}]})
        if "NOT JSON" in prompt:  # a proxy's HTML error page, or a server that is not OpenAI-compatible
            data = b"<html>bad gateway</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return None
        if "DOWN" in prompt:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        self._send({"choices": [{"message": {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                    "function": {"name": name, "arguments": json.dumps({"answer_status": status, "reason": "x"})}}]}}],
                    "usage": {"total_tokens": 9}})


@pytest.fixture()
def url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Judge.asked = []
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def test_sopr_rules(url):
    judge = SoPRJudge(url, "judge", runs=3)
    assert judge.judge("q", None, []) == ["Unsolved"] * 3 and _Judge.asked == []  # no answer: no LLM call
    assert judge.judge("q", "I give up and restart", []) == ["Unsolved"] * 3 and _Judge.asked == []
    assert judge.judge("q", '{"return_type": "give_up_and_restart"}', []) == ["Unsolved"] * 3
    assert _Judge.asked == []
    assert judge.judge("q", "Paris", []) == ["Solved"] * 3
    assert _Judge.asked == ["check_answer_status"] * 3
    _Judge.asked = []
    # Only a give-up is Unsolved unasked (StableToolBench: empty or give_up_and_restart); an answer that
    # mentions giving up is the judge model's to read.
    assert judge.judge_once("q", "We did not give up: Paris.", []) == "Solved"
    assert _Judge.asked == ["check_answer_status"]
    _Judge.asked = []
    assert judge.judge_once("q", "UNSURE answer", [{"name": "t", "response": "{}"}]) == "Solved"
    assert _Judge.asked == ["check_answer_status", "parse_answer_status"]  # Unsure -> second look
    assert judge.judge_once("q", "BAD", []) == "Unsolved" and judge.tokens > 0
    with pytest.raises(ValueError, match="runs"):
        SoPRJudge(url, "judge", runs=0)


def test_a_malformed_judgment_counts_as_unsure_and_a_failing_endpoint_stops_the_run(url):
    # A reply without the forced call crashed the run with "failed after 3 attempts: 'tool_calls'".
    from eval.judges import JudgeUnavailableError

    judge = SoPRJudge(url, "judge", runs=1, retries=1)
    assert judge.judge("q", "NO CALL", []) == ["Unsure"] and judge.malformed == 2  # the check, then the second look
    with pytest.raises(JudgeUnavailableError, match="--judge-url") as failed:
        judge.judge("q", "DOWN", [])
    # One line: httpx's HTTPStatusError text adds "\nFor more information check: <mdn url>".
    assert "\n" not in str(failed.value)


def test_a_judge_endpoint_answering_with_a_body_that_is_not_json_stops_the_run_with_one_line(url):
    # A 200 whose body is not JSON raised json.JSONDecodeError out of SoPRJudge._ask: a traceback
    # from `intent bench`, not the one-line error naming --judge-url.
    from eval.judges import JudgeUnavailableError

    judge = SoPRJudge(url, "judge", runs=1, retries=1)
    with pytest.raises(JudgeUnavailableError, match="--judge-url"):
        judge.judge("q", "NOT JSON", [])


def test_unreachable_judge_fails_at_startup():
    from eval.agents.chat import EndpointError

    with pytest.raises(EndpointError, match="cannot reach.*check --judge-url"):  # (it said "check --base-url")
        SoPRJudge("http://127.0.0.1:9/v1", "judge")


def test_a_judge_model_the_server_does_not_serve_fails_at_startup(url):
    from eval.agents.chat import EndpointError, check_model

    with pytest.raises(EndpointError, match="'wrong' is not served.*--judge-model"):
        SoPRJudge(url, "wrong")
    with pytest.raises(EndpointError, match="--base-url 'not-a-url' is not an http"):
        check_model("not-a-url", "m")


def _stabletoolbench_root_or_skip() -> None:
    """Skip (with the loader's reason) only when the StableToolBench data is not on this machine."""
    from eval.stabletoolbench import StbDataError, resolve_root

    try:
        resolve_root(None)
    except StbDataError as exc:  # the data is an optional download; anything else is a failure
        pytest.skip(f"StableToolBench data not available: {exc}")


def test_sopr_in_the_benchmark(url, tmp_path):
    from eval.runner import BenchConfig, run_benchmark

    _stabletoolbench_root_or_skip()
    cfg = BenchConfig(market="stabletoolbench", methods=["raw", "tracker"], tasks=6, out=str(tmp_path),
                      reference="raw", options={"judge": "sopr", "judge_url": url, "judge_model": "judge",
                                                "judge_runs": 2})
    summary = run_benchmark(cfg, progress=False)
    assert summary["config"]["judge"].startswith("SoPR")
    assert summary["methods"]["tracker"]["PR_std_over_judge_runs"] == 0.0  # the stub is deterministic


def test_unreachable_stabletoolbench_environments_fail_at_startup(tmp_path):
    from eval.agents.chat import EndpointError
    from eval.runner import BenchConfig, run_benchmark

    _stabletoolbench_root_or_skip()
    for env, err in (("server", ValueError), ("mirror", EndpointError)):
        cfg = BenchConfig(market="stabletoolbench", methods=["raw"], tasks=2, out=str(tmp_path / env), reference="raw",
                          options={"stb_env": env, "stb_env_url": "http://127.0.0.1:9/virtual"})
        with pytest.raises(err, match="cannot reach"):
            run_benchmark(cfg, progress=False)
        # Was: found after the retrieval, with prices.json and retrieval.json already written to OUT.
        assert not (tmp_path / env / "prices.json").exists() and not (tmp_path / env / "retrieval.json").exists()


class _DeadMirror(BaseHTTPRequestHandler):
    """A MirrorAPI-style endpoint that lists its model (the startup check passes) but answers every
    completion with HTTP 500."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        data = json.dumps({"data": [{"id": "mirror"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_episodes_whose_mirror_endpoint_failed_are_listed_as_crashed_not_counted_feasible(tmp_path):
    # With the simulator's endpoint answering 500 to every call, the run exited 0 with a normal table
    # (tracker FR 100.00, AC 44.67 on 6 queries) and no word that no tool response was ever simulated.
    from eval.runner import BenchConfig, run_benchmark

    _stabletoolbench_root_or_skip()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _DeadMirror)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        cfg = BenchConfig(market="stabletoolbench", methods=["raw", "tracker"], tasks=3, out=str(tmp_path),
                          reference="raw", options={"stb_env": "mirror", "stb_env_model": "mirror", "solvability": False,
                                                    "stb_env_url": f"http://127.0.0.1:{srv.server_address[1]}/v1"})
        summary = run_benchmark(cfg, progress=False)
        # OR's search stops the run instead of caching "unsolvable" verdicts from a dead endpoint.
        from eval.markets import EnvironmentUnavailableError

        searched = BenchConfig(market="stabletoolbench", methods=["raw"], tasks=2, out=str(tmp_path / "or"),
                               reference="raw", options={**cfg.options, "solvability": True})
        with pytest.raises(EnvironmentUnavailableError, match="--stb-env-url"):
            run_benchmark(searched, progress=False)
        cached = tmp_path / "or" / "solvability.json"
        assert not cached.exists() or '"solvable"' not in cached.read_text()  # no verdict was cached
    finally:
        srv.shutdown()
    tracker = summary["methods"]["tracker"]
    assert tracker["FR"] == 0.0 and tracker["PR"] == 0.0
    assert len(tracker["crashed"]) == 3
    from eval.results import ResultStore

    errors = [r.error for r in ResultStore(tmp_path / "episodes.jsonl").load() if r.method == "tracker"]
    assert all("--stb-env-url" in e and "500" in e for e in errors), errors
