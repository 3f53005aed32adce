"""Test doubles for our tests: the library's own (intent.testing) plus a few priced tools."""

from __future__ import annotations

from langchain_core.tools import StructuredTool, tool

from intent.testing import RunCounter, ScriptedToolModel, ai, call, scripted  # noqa: F401 - re-exported


@tool
def get_quote(symbol: str) -> str:
    """Stock quote for a ticker symbol."""
    return f'{{"symbol": "{symbol}", "price": 101.5}}'


@tool
def search_news(topic: str) -> str:
    """Latest news headlines about a topic."""
    return f'{{"topic": "{topic}", "headlines": ["a", "b"]}}'


@tool
def flaky(x: int) -> str:
    """A tool that always raises."""
    raise RuntimeError("upstream 503")


def priced_tools(runs: RunCounter, names: tuple[str, ...] = ("search", "fetch")) -> list[StructuredTool]:
    """Tools (sync and async) that count each run in ``runs`` where it happens and echo ``name:q``."""
    def make(name: str) -> StructuredTool:
        def run(q: str = "") -> str:
            runs.hit(name)
            return f"{name}:{q}"

        async def arun(q: str = "") -> str:
            runs.hit(name)
            return f"{name}:{q}"

        return StructuredTool.from_function(run, coroutine=arun, name=name, description=f"the {name} tool")

    return [make(n) for n in names]


def count_open_progress(monkeypatch, *also: tuple[object, str]) -> list[int]:
    """``intent.progress.progress`` (and each ``(module, name)`` in ``also`` that imported it) replaced by a wrapper
    that counts the reporters open now: the returned one-element list, for tests that some work runs under one."""
    import intent.progress

    real_progress, open_now = intent.progress.progress, [0]

    class Counted:
        def __init__(self, *args, **kwargs):
            self.inner = real_progress(*args, **kwargs)

        def __enter__(self):
            open_now[0] += 1
            return self.inner.__enter__()

        def __exit__(self, *exc):
            open_now[0] -= 1
            return self.inner.__exit__(*exc)

    for module, name in ((intent.progress, "progress"), *also):
        monkeypatch.setattr(module, name, Counted)
    return open_now


def judge_server(replies: list, model: str = "j"):
    """An OpenAI-compatible judge on 127.0.0.1 listing ``model``: each POST is answered with the next (HTTP status,
    JSON body) of ``replies`` (the last one repeats). Returns (server, its handler class, base URL); shut it down."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Server(BaseHTTPRequestHandler):
        posts = 0

        def log_message(self, *args):
            pass

        def _send(self, code: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"data": [{"id": model}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            code, body = replies[min(type(self).posts, len(replies) - 1)]
            type(self).posts += 1
            self._send(code, body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, Server, f"http://127.0.0.1:{srv.server_address[1]}/v1"
