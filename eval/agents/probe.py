"""``intent probe --base-url URL --model NAME``: does a served model produce well-formed tool calls?

Sends a few tool-calling prompts (``tool_choice: auto``, temperature 0) to an OpenAI-compatible
``/chat/completions`` and classifies each reply:

* ``tool_call``: ``message.tool_calls`` holds calls of offered tools with JSON-object arguments;
* ``malformed``: tool calls with an unknown name or arguments that are not a JSON object;
* ``text_call``: no ``tool_calls``, but the text holds a call (a fenced JSON block, ``<tool_call>`` tags):
  the server's tool parser missed it (serve with ``--tool-parser-plugin intent_vllm/vllm_plugin.py
  --tool-call-parser intent_lenient``, as ``scripts/serve_llm.sh`` does);
* ``no_call``: a plain answer.

It prints one line per prompt and the rate of well-formed calls; the exit code is 1 below
``--min-rate``. An unreachable endpoint, an unknown model, or a server without tool calling
enabled is a one-line error (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eval.agents.chat import EndpointError, check_model
from intent.errors import UsageError

__all__ = ["PROBES", "ProbeResult", "classify", "main_probe", "run_probe"]


def _tool(name: str, description: str, **props: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
                       "required": list(props)}}}


_TOOLS = [
    _tool("get_stock_price", "Latest price of a stock. Costs 7.", symbol="ticker symbol, e.g. ACME"),
    _tool("weather_lookup", "Weather forecast for a city and day. Costs 5.", city="city name", day="today or tomorrow"),
    _tool("currency_convert", "Convert an amount between currencies. Costs 4.", amount="amount as a number",
          base="currency code to convert from", quote="currency code to convert to"),
    _tool("search_news", "Recent news headlines on a topic. Costs 6.", topic="what to search for"),
]
# (user prompt, the tool a sensible agent calls)
PROBES: list[tuple[str, str]] = [
    ("What is the current stock price of ACME?", "get_stock_price"),
    ("Will it rain in Oslo tomorrow?", "weather_lookup"),
    ("How much is 250 USD in EUR?", "currency_convert"),
    ("Find the latest news about space launches.", "search_news"),
]
SYSTEM = "You are an agent with paid tools. Call a tool when you need information; then answer briefly."


@dataclass
class ProbeResult:
    prompt: str
    expected: str
    outcome: str  # tool_call | malformed | text_call | no_call
    calls: list[str] = field(default_factory=list)
    duplicates: int = 0
    seconds: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str = ""
    text: str = ""


def classify(message: dict[str, Any], tool_names: set[str]) -> tuple[str, list[str], int]:
    """(outcome, call names, duplicate calls) of one chat-completion message."""
    calls = message.get("tool_calls") or []
    names, keys, well_formed = [], [], True
    for call in calls:
        fn = call.get("function") or {} if isinstance(call, dict) else {}
        name = fn.get("name")
        names.append(str(name))
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            args = None
        if name not in tool_names or not isinstance(args, dict):
            well_formed = False
        keys.append(f"{name}\x00{json.dumps(args, sort_keys=True)}")
    duplicates = len(keys) - len(set(keys))
    if calls:
        return ("tool_call" if well_formed else "malformed"), names, duplicates
    text = message.get("content") or ""
    parsed = _lenient(text, tool_names)
    if parsed is not None and parsed.calls:
        return "text_call", [c.name for c in parsed.calls], parsed.duplicates
    return "no_call", [], 0


def _lenient(text: str, tool_names: set[str]) -> Any:
    try:
        from intent_vllm.parsing import parse_tool_calls
    except ImportError:  # the package sits at the repository root, beside eval/
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        try:
            from intent_vllm.parsing import parse_tool_calls
        except ImportError:
            return None
    return parse_tool_calls(text, tool_names)


def _post(url: str, body: dict[str, Any], api_key: str, timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - user-given URL
            return json.loads(response.read().decode())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", {}).get("message", detail) if detail.startswith("{") else detail
        except (ValueError, AttributeError):
            pass
        hint = ""
        if "enable-auto-tool-choice" in str(detail) or "tool-call-parser" in str(detail):
            hint = ("; start the server with tool calling on (scripts/serve_llm.sh does: --enable-auto-tool-choice "
                    "--tool-parser-plugin intent_vllm/vllm_plugin.py --tool-call-parser intent_lenient)")
        raise EndpointError(f"{url} answered HTTP {exc.code}: {str(detail).strip()[:300]}{hint}") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise EndpointError(f"cannot reach {url}: {exc}; check --base-url and that the server is running") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise EndpointError(f"{url} did not answer with JSON; is --base-url the server's /v1 root?") from exc


def run_probe(base_url: str, model: str, *, api_key: str | None = None, max_tokens: int = 256,
              timeout: float = 180.0, probes: list[tuple[str, str]] | None = None,
              echo: Any = None) -> list[ProbeResult]:
    """Run the probes against ``base_url``; raises :class:`EndpointError` (one line) when it cannot."""
    api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    check_model(base_url, model, api_key=api_key, flag="--model ")
    url = base_url.rstrip("/") + "/chat/completions"
    names = {t["function"]["name"] for t in _TOOLS}
    results = []
    for prompt, expected in probes or PROBES:
        started = time.perf_counter()
        data = _post(url, {"model": model, "temperature": 0, "max_tokens": max_tokens, "tools": _TOOLS,
                           "tool_choice": "auto",
                           "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]},
                     api_key, timeout)
        seconds = time.perf_counter() - started
        try:
            choice = data["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError) as exc:
            raise EndpointError(f"{url} answered without choices[0].message: {str(data)[:200]}") from exc
        outcome, calls, duplicates = classify(message, names)
        usage = data.get("usage") or {}
        result = ProbeResult(prompt=prompt, expected=expected, outcome=outcome, calls=calls, duplicates=duplicates,
                             seconds=round(seconds, 2), completion_tokens=int(usage.get("completion_tokens", 0)),
                             prompt_tokens=int(usage.get("prompt_tokens", 0)),
                             finish_reason=str(choice.get("finish_reason", "")),
                             text=(message.get("content") or "")[:160])
        results.append(result)
        if echo:
            echo(_line(result))
    return results


def _line(r: ProbeResult) -> str:
    calls = ", ".join(r.calls) or "-"
    dup = f", {r.duplicates} duplicate" if r.duplicates else ""
    return (f"{r.outcome:<9} {r.seconds:5.1f} s {r.completion_tokens:4d} tok  calls: {calls}{dup}  "
            f"(expected {r.expected}; finish {r.finish_reason})")


def summary(results: list[ProbeResult]) -> dict[str, Any]:
    n = len(results)
    ok = sum(r.outcome == "tool_call" for r in results)
    seconds = sum(r.seconds for r in results)
    tokens = sum(r.completion_tokens for r in results)
    return {"probes": n, "well_formed": ok, "rate": ok / n if n else 0.0,
            "text_calls": sum(r.outcome == "text_call" for r in results),
            "malformed": sum(r.outcome == "malformed" for r in results),
            "expected_tool": sum(r.expected in r.calls for r in results if r.outcome == "tool_call"),
            "duplicates": sum(r.duplicates for r in results),
            "completion_tokens_per_s": round(tokens / seconds, 1) if seconds else None}


def main_probe(args: argparse.Namespace) -> int:
    if not 0.0 <= args.min_rate <= 1.0:
        raise UsageError(f"--min-rate must be between 0 and 1, got {args.min_rate}")
    print(f"probing {args.model} at {args.base_url} with {len(PROBES)} tool-calling prompts ...", flush=True)
    results = run_probe(args.base_url, args.model, api_key=args.api_key, max_tokens=args.max_tokens,
                        timeout=args.timeout, echo=lambda line: print("  " + line, flush=True))
    s = summary(results)
    print(f"well-formed tool calls: {s['well_formed']}/{s['probes']} ({100 * s['rate']:.0f}%); the expected tool "
          f"in {s['expected_tool']}; {s['duplicates']} duplicate calls; "
          + (f"{s['completion_tokens_per_s']} completion tok/s (one stream)" if s["completion_tokens_per_s"] is not None
             else "completion tok/s unknown (the server reported no usage)"))
    if s["text_calls"]:
        print(f"{s['text_calls']} replies wrote a tool call as text that the server did not parse: serve with "
              "--tool-parser-plugin intent_vllm/vllm_plugin.py --tool-call-parser intent_lenient "
              "(scripts/serve_llm.sh)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"base_url": args.base_url, "model": args.model, **s,
                                                   "results": [asdict(r) for r in results]}, indent=2))
    if s["rate"] < args.min_rate:
        print(f"FAIL: {100 * s['rate']:.0f}% well-formed tool calls is below --min-rate {args.min_rate:.2f}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # python -m eval.agents.probe --base-url URL --model NAME
    import intent.cli

    raise SystemExit(intent.cli.main(["probe", *sys.argv[1:]]))
