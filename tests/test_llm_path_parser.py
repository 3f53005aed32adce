"""The lenient tool-call parser (intent_vllm/parsing.py) on what small models really write.

The replies below follow Qwen2.5-Coder-0.5B-Instruct's habits measured here: calls as ```json fenced
blocks without <tool_call> tags, the same call repeated in one reply, text after the call, replies cut
by the token cap. The parser must find every complete call and never raise. The vLLM wrapper
(intent_vllm/vllm_plugin.py) is exercised in .venv-vllm when it exists.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from intent_vllm.parsing import parse_tool_calls  # noqa: E402

TOOLS = ["get_stock_price", "search_news", "weather_lookup"]
CALL = '{"name": "get_stock_price", "arguments": {"symbol": "ACME"}}'


def names(result):
    return [(c.name, c.arguments) for c in result.calls]


def test_fenced_json_block_without_tags_is_a_call():
    r = parse_tool_calls(f"```json\n{CALL}\n```", TOOLS)
    assert names(r) == [("get_stock_price", {"symbol": "ACME"})]
    assert r.content is None and r.malformed == 0 and r.duplicates == 0


def test_repeated_identical_calls_are_all_returned_and_counted_as_duplicates():
    reply = "\n".join([f"```json\n{CALL}\n```"] * 5)
    r = parse_tool_calls(reply, TOOLS)
    assert len(r.calls) == 5 and r.duplicates == 4
    assert r.content is None


def test_trailing_text_stays_as_content():
    reply = f"I will look up the price.\n```json\n{CALL}\n```\nOnce I have it, I will tell you."
    r = parse_tool_calls(reply, TOOLS)
    assert names(r) == [("get_stock_price", {"symbol": "ACME"})]
    assert r.content == "I will look up the price.\n\nOnce I have it, I will tell you."


def test_invalid_json_gives_no_call_and_counts_as_malformed():
    reply = '```json\n{"name": "get_stock_price", "arguments": {"symbol": ACME}}\n```'
    r = parse_tool_calls(reply, TOOLS)
    assert r.calls == [] and r.malformed == 1 and r.content == reply


def test_reply_cut_by_the_token_cap_is_malformed_not_a_call():
    reply = f"```json\n{CALL}\n```\n```json\n" + '{"name": "get_stock_price", "arguments": {"sym'
    r = parse_tool_calls(reply, TOOLS)
    assert len(r.calls) == 1 and r.malformed == 1


def test_tool_call_tags_several_calls_in_order():
    reply = ('<tool_call>\n{"name": "search_news", "arguments": {"topic": "mars"}}\n</tool_call>\n'
             f"<tool_call>\n{CALL}\n</tool_call>")
    r = parse_tool_calls(reply, TOOLS)
    assert [c.name for c in r.calls] == ["search_news", "get_stock_price"]
    assert r.content is None


def test_broken_tool_call_tag_is_malformed():
    r = parse_tool_calls("<tool_call>\nget_stock_price(ACME)\n</tool_call>", TOOLS)
    assert r.calls == [] and r.malformed == 1


def test_bare_object_in_prose_and_argument_variants():
    reply = ('Sure. {"name": "weather_lookup", "parameters": {"city": "Oslo"}} then '
             '{"name": "get_stock_price", "arguments": "{\\"symbol\\": \\"ACME\\"}"}')
    r = parse_tool_calls(reply, TOOLS)
    assert names(r) == [("weather_lookup", {"city": "Oslo"}), ("get_stock_price", {"symbol": "ACME"})]
    assert r.content == "Sure.  then"


def test_list_of_calls_with_a_trailing_comma_and_an_invented_name():
    reply = ('```json\n[{"name": "get_stock_price", "arguments": {"symbol": "A"}},\n'
             ' {"name": "get_stock_news", "arguments": {"symbol": "A"}},]\n```')
    r = parse_tool_calls(reply, TOOLS)
    assert [c.name for c in r.calls] == ["get_stock_price", "get_stock_news"]
    assert r.unknown == ["get_stock_news"]


def test_plain_answers_and_json_data_are_not_calls():
    for reply in ["The price of ACME is 12.5.", '```json\n{"name": "Alice", "age": 3}\n```',
                  '```python\nprint({"a": 1})\n```', "", None]:
        r = parse_tool_calls(reply, TOOLS)
        assert r.calls == [] and r.malformed == 0, reply


def test_known_tool_without_arguments_is_a_call_unknown_name_without_arguments_is_data():
    assert names(parse_tool_calls('{"name": "search_news"}', TOOLS)) == [("search_news", {})]
    assert parse_tool_calls('{"name": "search"}', TOOLS).calls == []


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('{}[]":,<>/`\n abcnmejsoptl_0123456789')) , max_size=200))
def test_never_raises_on_garbage(text):
    r = parse_tool_calls(text, TOOLS)
    assert all(isinstance(c.arguments, dict) and c.name for c in r.calls)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(TOOLS), min_size=1, max_size=4), st.sampled_from(["fence", "tag", "bare"]))
def test_every_complete_call_is_found(tools, wrap):
    parts = []
    for i, tool in enumerate(tools):
        call = json.dumps({"name": tool, "arguments": {"i": i}})
        parts.append({"fence": f"```json\n{call}\n```", "tag": f"<tool_call>\n{call}\n</tool_call>", "bare": call}[wrap])
    r = parse_tool_calls("Let me see.\n" + "\n".join(parts) + "\nDone.", TOOLS)
    assert [(c.name, c.arguments) for c in r.calls] == [(t, {"i": i}) for i, t in enumerate(tools)]
    assert r.malformed == 0


VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PY.exists(), reason="needs .venv-vllm (scripts/vllm_venv.sh)")
def test_vllm_plugin_registers_and_turns_a_fenced_block_into_tool_calls():
    code = """
import json, sys
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
plugin, good, bad_text = json.loads(sys.argv[1])
ToolParserManager.import_tool_parser(plugin)
cls = ToolParserManager.get_tool_parser("intent_lenient")
req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function",
      "function": {"name": "get_stock_price", "parameters": {"type": "object"}}}])
p = cls(tokenizer=object(), tools=req.tools)
r = p.extract_tool_calls(good, req)
bad = p.extract_tool_calls(bad_text, req)
print(json.dumps([r.tools_called, [(c.function.name, c.function.arguments) for c in r.tool_calls], r.content,
                  bad.tools_called, bad.content]))
"""
    inputs = [str(ROOT / "intent_vllm" / "vllm_plugin.py"), f"```json\n{CALL}\n```\n```json\n{CALL}\n```\nthanks",
              '```json\n{"name": "get_stock_price", "arguments": {x}}\n```']
    out = subprocess.run([str(VLLM_PY), "-c", code, json.dumps(inputs)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    called, calls, content, bad_called, bad_content = json.loads(out.stdout.strip().splitlines()[-1])
    assert called and calls == [["get_stock_price", '{"symbol": "ACME"}']] * 2 and content == "thanks"
    assert not bad_called and "get_stock_price" in bad_content
