"""MirrorAPI-style and StableToolBench-server environments against a tiny local HTTP stub."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytest.importorskip("httpx")

from eval.stabletoolbench import OpenAICompatibleSimulator, ServerEnvironment, StbApi, parse_simulator_output  # noqa: E402
from eval.stabletoolbench.loader import Param  # noqa: E402

API = StbApi(
    category="Data",
    tool_name="Kick.com API | Kick API",
    api_name="Get Channel Clips",
    description="Get Channel Clips",
    required=(Param("channel_name", "STRING", "", "gmhikaru"),),
    optional=(Param("ID", "STRING", "", ""),),
)
FN = "get_channel_clips_for_kick_com_api_kick_api"
STUB_LIFETIME_S = 30.0  # the stub shuts itself down after this, whatever happens


@dataclass
class Stub:
    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    replies: list[tuple[int, str, float]] = field(default_factory=list)  # (status, body, delay)

    def reply(self, status: int = 200, body: Any = None, delay: float = 0.0) -> None:
        text = body if isinstance(body, str) else json.dumps(body)
        self.replies.append((status, text, delay))


@pytest.fixture()
def stub() -> Iterator[Stub]:
    state = Stub(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length).decode()
            state.requests.append({"path": self.path, "headers": dict(self.headers), "body": json.loads(raw)})
            status, text, delay = state.replies.pop(0) if state.replies else (500, "no reply queued", 0.0)
            if delay:
                time.sleep(delay)
            data = text.encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    watchdog = threading.Timer(STUB_LIFETIME_S, server.shutdown)
    watchdog.daemon = True
    watchdog.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        watchdog.cancel()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# ------------------------------------------------------------------ server environment


def test_server_request_and_success(stub: Stub) -> None:
    stub.reply(200, {"error": "", "response": {"clips": [1, 2]}})
    with ServerEnvironment(stub.url, [API], toolbench_key="k1", timeout=30) as env:
        r = env.call(FN, '{"channel_name": "gmhikaru"}')
    assert r.ok and r.environment == "stabletoolbench-server"
    assert json.loads(r.observation) == {"error": "", "response": {"clips": [1, 2]}}
    req = stub.requests[0]
    assert req["path"] == "/virtual"
    assert req["body"] == {
        "category": "Data",
        "tool_name": "kick_com_api_kick_api",
        "api_name": "get_channel_clips",
        "tool_input": '{"channel_name": "gmhikaru"}',
        "strip": "",
        "toolbench_key": "k1",
    }
    assert req["headers"].get("toolbench_key") == "k1"


@pytest.mark.parametrize(
    ("error", "code"),
    [("Unauthorized error...", 7), ("API not working error...", 6), ("Rate limit per minute error...", 10),
     ("Tool input parse error...\n", 0)],
)
def test_server_error_codes(stub: Stub, error: str, code: int) -> None:
    stub.reply(200, {"error": error, "response": ""})
    with ServerEnvironment(stub.url + "/virtual", [API], timeout=30) as env:
        r = env.call(FN, "{}")
    assert r.status_code == code and r.error == error and not r.ok


def test_server_http_failures(stub: Stub) -> None:
    stub.reply(503, {"detail": "down"})
    stub.reply(200, "not json")
    stub.reply(200, {"error": "", "response": "late"}, delay=1.5)
    with ServerEnvironment(stub.url, [API], timeout=30) as env:
        r1 = env.call(FN, "{}")
        r2 = env.call(FN, "{}")
        # (A short timeout for the late reply only: the stub answering in time is not a race a loaded machine
        # can lose, as it was with 0.3 s for every request.)
        env.timeout = 0.3
        r3 = env.call(FN, "{}")
        r4 = env.call("nope_for_nothing", "{}")
    assert r1.status_code == 12 and "status_code=503" in r1.observation
    assert r2.status_code == 12
    assert r3.status_code == 5 and json.loads(r3.observation)["error"] == "Timeout error..."
    assert r4.status_code == 1 and len(stub.requests) == 3  # unknown names never reach the server


def test_server_truncates(stub: Stub) -> None:
    stub.reply(200, {"error": "", "response": "y" * 5000})
    with ServerEnvironment(stub.url, [API], timeout=30) as env:
        r = env.call(FN, "{}")
    assert len(r.observation) == 1027 and r.observation.endswith("...")


# ------------------------------------------------------------------ MirrorAPI-style simulator


def _completion(content: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


def test_mirror_request_and_parse(stub: Stub) -> None:
    stub.reply(200, _completion('{"error": "", "response": "{\\"clips\\": [\\"a\\"]}"}'))
    env = OpenAICompatibleSimulator([API], base_url=stub.url + "/v1", model="mirror-test", api_key="sk-x", timeout=30)
    try:
        r = env.call(FN, '{"channel_name": "gmhikaru", "toolbench_key": "secret"}')
        again = env.call(FN, {"toolbench_key": "secret", "channel_name": "gmhikaru"})
    finally:
        env.close()
    assert r.ok and r.environment == "mirrorapi-simulated:mirror-test"
    assert json.loads(r.observation) == {"error": "", "response": '{"clips": ["a"]}'}
    assert again == r and len(stub.requests) == 1  # cached per (function, canonical args)
    req = stub.requests[0]
    assert req["path"] == "/v1/chat/completions"
    assert req["headers"].get("Authorization") == "Bearer sk-x"
    body = req["body"]
    assert body["model"] == "mirror-test" and body["temperature"] == 0.1
    assert body["max_tokens"] == 2048 and body["seed"] == 42
    system, user = body["messages"]
    assert system["role"] == "system" and '"error": ""' in system["content"]
    assert user["content"].startswith("API doc:\n{'api_name': 'Get Channel Clips'")
    assert "'tool_name': 'kick_com_api_kick_api', 'tool_category': 'Data'}" in user["content"]
    assert user["content"].endswith("\n\nRequest:\n{'channel_name': 'gmhikaru'}")
    assert "secret" not in user["content"]


def test_mirror_regex_fallback_and_failure(stub: Stub) -> None:
    stub.reply(200, _completion('{"error": "", "response": "{"status":0,"languages":["en"]}"}'))
    stub.reply(200, _completion("I cannot help with that."))
    stub.reply(500, {"detail": "boom"})
    env = OpenAICompatibleSimulator([API], base_url=stub.url, model="m", timeout=30)
    try:
        r1 = env.call(FN, '{"channel_name": "a"}')
        r2 = env.call(FN, '{"channel_name": "b"}')
        r3 = env.call(FN, '{"channel_name": "c"}')
        r4 = env.call(FN, "{broken")
    finally:
        env.close()
    assert r1.ok and json.loads(r1.observation)["response"].startswith('{"status":0')
    assert r2.error == "Failed to generate fake response" and not r2.ok
    assert r3.status_code == 12
    assert r4.error == "Tool input parse error...\n" and len(stub.requests) == 3


def test_parse_simulator_output() -> None:
    assert parse_simulator_output('```json\n{"error": "", "response": {"a": 1}}\n```') == ("", {"a": 1})
    assert parse_simulator_output('{"mechanism_of_the_api": "m", "error": "", "response": "r') == ("", "r")
    assert parse_simulator_output("nothing here") is None
    assert parse_simulator_output('{"other": 1}') is None
