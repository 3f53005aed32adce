"""vLLM tool-parser plugin ``intent_lenient``: tool calls from small models that skip the tags.

Load it with::

    vllm serve MODEL --enable-auto-tool-choice \\
        --tool-parser-plugin /path/to/intent_vllm/vllm_plugin.py --tool-call-parser intent_lenient

vLLM imports this file by path (``vllm.utils.import_utils.import_plugin``), so it puts its
repository root on ``sys.path`` to reach :mod:`intent_vllm.parsing`, the pure, separately tested
parser (``<tool_call>`` tags, fenced ```json blocks, any complete ``{"name", "arguments"}`` object).
Written against vLLM 0.32's ``vllm.tool_parsers.abstract_tool_parser.ToolParser``.

Non-streaming replies are parsed whole. Streaming emits each call once its JSON is complete, and
streams text only until the first call-like marker (``<tool_call>``, a code fence or ``{``).

``INTENT_TOOL_PARSE_LOG=FILE`` appends one JSON line per parsed reply (calls, malformed,
duplicates, unknown names, characters): the benchmark's malformed- and duplicate-call rates.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from intent_vllm.parsing import ParseResult, parse_tool_calls  # noqa: E402
from vllm.entrypoints.generate.base.protocol import (  # noqa: E402
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.renderers.chat_utils import make_tool_call_id  # noqa: E402
from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager  # noqa: E402

logger = init_logger(__name__)
_LOG_LOCK = threading.Lock()
_MARKERS = ("<tool_call>", "```", "{")


def _tool_names(request: object) -> list[str] | None:
    tools = getattr(request, "tools", None)
    if not tools:
        return None
    names = []
    for tool in tools:
        function = getattr(tool, "function", None)
        name = getattr(function, "name", None) or getattr(tool, "name", None)
        if name:
            names.append(name)
    return names or None


def _log(result: ParseResult, chars: int, streaming: bool) -> None:
    path = os.environ.get("INTENT_TOOL_PARSE_LOG")
    if not path:
        return
    line = json.dumps({"t": round(time.time(), 3), **result.stats(), "chars": chars, "streaming": streaming})
    try:
        with _LOG_LOCK, open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:  # the log is a diagnostic: never fail a reply over it
        logger.warning("intent_lenient: cannot append to INTENT_TOOL_PARSE_LOG=%s", path)


class LenientToolParser(ToolParser):
    """Tool calls from ``<tool_call>`` tags, fenced JSON, or bare ``{"name", "arguments"}`` objects."""

    def __init__(self, tokenizer, tools=None):  # noqa: ANN001 - vLLM's signature
        super().__init__(tokenizer, tools)
        self._emitted = 0
        self._text_closed = False

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:  # noqa: ANN001
        try:
            result = parse_tool_calls(model_output, _tool_names(request))
        except Exception:  # noqa: BLE001 - a parser bug must not fail the request: return the text
            logger.exception("intent_lenient: parsing failed; returning the reply as text")
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        _log(result, len(model_output), streaming=False)
        if not result.calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        calls = [ToolCall(type="function", function=FunctionCall(
            name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False))) for c in result.calls]
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=result.content)

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request,  # noqa: ANN001
    ) -> DeltaMessage | None:
        content = None
        if not self._text_closed:
            cut = min((i for i in (current_text.find(m) for m in _MARKERS) if i >= 0), default=-1)
            if cut < 0:
                content = delta_text
            else:
                self._text_closed = True
                start = len(previous_text)
                content = current_text[start:cut] if cut > start else None
        try:
            result = parse_tool_calls(current_text, _tool_names(request))
        except Exception:  # noqa: BLE001
            logger.exception("intent_lenient: streaming parse failed")
            return DeltaMessage(content=content) if content else None
        deltas = []
        for call in result.calls[self._emitted:]:
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            deltas.append(DeltaToolCall(index=self._emitted, id=make_tool_call_id(), type="function",
                                        function=DeltaFunctionCall(name=call.name, arguments=arguments)))
            self.prev_tool_call_arr.append({"name": call.name, "arguments": call.arguments})
            self.streamed_args_for_tool.append(arguments)
            self.current_tool_id = self._emitted
            self._emitted += 1
        if not deltas and not content:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas)


ToolParserManager.register_module(name="intent_lenient", module=LenientToolParser)
