"""Serving helpers for small open models behind vLLM: a lenient tool-call parser.

``intent_vllm.parsing.parse_tool_calls`` is pure Python (tested in the main venv);
``intent_vllm/vllm_plugin.py`` wraps it as a vLLM tool-parser plugin::

    vllm serve MODEL --enable-auto-tool-choice \\
        --tool-parser-plugin intent_vllm/vllm_plugin.py --tool-call-parser intent_lenient
"""

from intent_vllm.parsing import ParseResult, ParsedCall, parse_tool_calls

__all__ = ["ParseResult", "ParsedCall", "parse_tool_calls"]
