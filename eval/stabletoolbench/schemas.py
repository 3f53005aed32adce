"""OpenAI tool schemas for StableToolBench APIs, as ``api_json_to_openai_json`` builds them.

Faithful details (checked against the ``data_example`` answer files):

* name: ``(change_name(standardize(api_name)) + "_for_" + standardize(tool_name))[-64:]``;
* description: ``This is the subfunction for tool "<std tool>", you can use this tool.`` followed
  (no space) by ``The description of this function is: "<desc>"`` when the API has a description,
  where ``desc = api_description.strip().replace(api_name, function_name)[:256]``;
* parameters: name ``change_name(standardize(name))``; type NUMBER->integer, STRING->string,
  BOOLEAN->boolean, anything else (including lower-case ``string``) -> string; description cut to
  256 characters; a default whose ``str()`` is non-empty becomes ``example_value``;
* upstream quirk: optional parameters are only added when the API has at least one required
  parameter (an API with only optional parameters gets ``"properties": {}``);
* ``required`` / ``optional`` start as ``[]`` (as in BTP and the data_example files; the current
  upstream template starts them as ``[""]``).
"""

from __future__ import annotations

from typing import Any

from .loader import Param, StbApi
from .naming import standardize

__all__ = ["DESCRIPTION_MAX_LENGTH", "FINISH_NAME", "TYPE_MAP", "finish_tool_schema", "openai_tool_schema"]

DESCRIPTION_MAX_LENGTH = 256
TYPE_MAP: dict[str, str] = {"NUMBER": "integer", "STRING": "string", "BOOLEAN": "boolean"}
FINISH_NAME = "Finish"

_FINISH_DESCRIPTION = (
    "If you believe that you have obtained a result that can answer the task, please call this "
    "function to provide the final answer. Alternatively, if you recognize that you are unable to "
    "proceed with the task in the current state, call this function to restart. Remember: you must "
    "ALWAYS call this function at the end of your attempt, and the only part that will be shown to "
    "the user is the final answer, so it should contain sufficient information."
)


def _param_schema(p: Param) -> tuple[str, dict[str, Any]]:
    prop: dict[str, Any] = {
        "type": TYPE_MAP.get(p.type, "string"),
        "description": p.description[:DESCRIPTION_MAX_LENGTH],
    }
    if len(str(p.default)) != 0:
        prop["example_value"] = p.default
    return p.schema_name, prop


def function_description(api: StbApi) -> str:
    """The function description text the agent sees."""
    text = f'This is the subfunction for tool "{standardize(api.tool_name)}", you can use this tool.'
    desc = api.description.strip()
    if desc != "":
        cut = desc.replace(api.api_name, api.function_name)[:DESCRIPTION_MAX_LENGTH]
        text += f'The description of this function is: "{cut}"'
    return text


def openai_tool_schema(api: StbApi) -> dict[str, Any]:
    """``{"type": "function", "function": {name, description, parameters}}`` for one API."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    optional: list[str] = []
    if api.required:  # upstream quirk: optional parameters only inside this branch
        for p in api.required:
            name, prop = _param_schema(p)
            properties[name] = prop
            required.append(name)
        for p in api.optional:
            name, prop = _param_schema(p)
            properties[name] = prop
            optional.append(name)
    return {
        "type": "function",
        "function": {
            "name": api.function_name,
            "description": function_description(api),
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "optional": optional,
            },
        },
    }


def finish_tool_schema() -> dict[str, Any]:
    """The ``Finish`` function (return_type give_answer | give_up_and_restart, final_answer)."""
    return {
        "type": "function",
        "function": {
            "name": FINISH_NAME,
            "description": _FINISH_DESCRIPTION,
            "parameters": {
                "type": "object",
                "properties": {
                    "return_type": {"type": "string", "enum": ["give_answer", "give_up_and_restart"]},
                    "final_answer": {
                        "type": "string",
                        "description": (
                            "The final answer you want to give the user. You should have this field "
                            'if "return_type"=="give_answer"'
                        ),
                    },
                },
                "required": ["return_type"],
            },
        },
    }
