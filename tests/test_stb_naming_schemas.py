"""StableToolBench naming and schemas: hand cases and every function of the data_example files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.stabletoolbench import (
    StbApi,
    StbDataError,
    change_name,
    finish_tool_schema,
    function_name,
    load_queries,
    openai_tool_schema,
    resolve_root,
    standardize,
    standardize_category,
)
from eval.stabletoolbench.loader import Param


def _root_or_skip() -> Path:
    try:
        return resolve_root()
    except StbDataError as exc:
        pytest.skip(f"StableToolBench data not available: {exc}")


# ------------------------------------------------------------------ naming hand cases


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("ID", "id"),
        ("Songkick concert", "songkick_concert"),
        ("Kick.com API | Kick API", "kick_com_api_kick_api"),
        ("Get Chat User (like user from chat)", "get_chat_user_like_user_from_chat"),
        ("PopularSitesForQuery", "popularsitesforquery"),
        ("168predict VIP Football Predictions", "get_168predict_vip_football_predictions"),
        ("10000+ Anime Quotes", "get_10000_anime_quotes"),
        ("_3d__model_", "get_3d_model"),
        ("a^b", "a^b"),  # the regex quirk: ^ is a literal inside the class and survives
        ("x ^ y", "x_^_y"),
        ("天气 API", "天气_api"),  # CJK kept
        ("Hello__World!!", "hello_world"),
        ("!!!", ""),
        ("", ""),
        ("café", "caf"),  # non-ASCII letters outside the CJK range are replaced
    ],
)
def test_standardize(raw: str, expected: str) -> None:
    assert standardize(raw) == expected


def test_change_name() -> None:
    assert change_name(standardize("ID")) == "is_id"
    for word in ("from", "class", "return", "false", "true", "id", "and"):
        assert change_name(word) == "is_" + word
    assert change_name("ids") == "ids"
    assert change_name("From") == "From"  # only applied after standardize lowercases


def test_standardize_category() -> None:
    assert standardize_category("Video, Images") == "Video_Images"
    assert standardize_category("News, Media") == "News_Media"
    assert standardize_category("Artificial Intelligence/Machine Learning") == "Artificial_Intelligence_Machine_Learning"
    assert standardize_category("Data") == "Data"


def test_function_name_rules() -> None:
    assert function_name("TheClique", "Songkick concert") == "songkick_concert_for_theclique"
    assert function_name("Some Tool", "ID") == "is_id_for_some_tool"
    assert function_name("3D Services", "list") == "list_for_get_3d_services"
    # truncation keeps the LAST 64 characters
    full = "driver_s_quotes_with_pagination_of_10_quotes_each_page_for_f1_drivers_quotes"
    name = function_name("F1 drivers quotes", "Driver's quotes with pagination of 10 quotes each page")
    assert len(full) > 64 and name == full[-64:] and len(name) == 64
    assert name == "tes_with_pagination_of_10_quotes_each_page_for_f1_drivers_quotes"


def test_schema_hand_case() -> None:
    api = StbApi(
        category="Data",
        tool_name="My Tool",
        api_name="Get Thing",
        description="  Use Get Thing to fetch a thing.  ",
        required=(Param("ID", "NUMBER", "d" * 300, 5),),
        optional=(Param("flag", "BOOLEAN", "", ""), Param("when", "DATE", "day", None)),
    )
    fn = openai_tool_schema(api)["function"]
    assert fn["name"] == "get_thing_for_my_tool"
    assert fn["description"] == (
        'This is the subfunction for tool "my_tool", you can use this tool.'
        'The description of this function is: "Use get_thing_for_my_tool to fetch a thing."'
    )
    props = fn["parameters"]["properties"]
    assert props["is_id"] == {"type": "integer", "description": "d" * 256, "example_value": 5}
    assert props["flag"] == {"type": "boolean", "description": ""}
    assert props["when"] == {"type": "string", "description": "day", "example_value": None}  # str(None) != ""
    assert fn["parameters"]["required"] == ["is_id"] and fn["parameters"]["optional"] == ["flag", "when"]


def test_schema_optional_only_quirk() -> None:
    api = StbApi("Data", "T", "A", "", (), (Param("q", "STRING", "", "x"),))
    params = openai_tool_schema(api)["function"]["parameters"]
    assert params == {"type": "object", "properties": {}, "required": [], "optional": []}
    assert openai_tool_schema(api)["function"]["description"] == 'This is the subfunction for tool "t", you can use this tool.'


def test_finish_schema() -> None:
    fn = finish_tool_schema()["function"]
    assert fn["name"] == "Finish"
    assert fn["parameters"]["required"] == ["return_type"]
    assert fn["parameters"]["properties"]["return_type"]["enum"] == ["give_answer", "give_up_and_restart"]


# ------------------------------------------------------------------ against data_example


def _walk_names(node, out: set[str]) -> None:
    if isinstance(node, dict):
        if node.get("node_type") == "Action" and isinstance(node.get("description"), str):
            out.add(node["description"])
        if isinstance(node.get("name"), str) and ("arguments" in node or "response" in node):
            out.add(node["name"])
        for v in node.values():
            _walk_names(v, out)
    elif isinstance(node, list):
        for v in node:
            _walk_names(v, out)


def test_every_data_example_function_is_rebuilt() -> None:
    root = _root_or_skip()
    answers = sorted((root / "data_example" / "answer").glob("*/*/*.json"))
    converted = sorted((root / "data_example" / "model_predictions_converted").glob("*/*.json"))
    if not answers:
        pytest.skip("data_example/answer files not present")
    by_id = {q.query_id: q for q in load_queries(groups=["G1_instruction"])}
    checked_functions = 0
    all_built: set[str] = set()
    for path in answers:
        qid = int(path.name.split("_")[0])
        data = json.loads(path.read_text())
        theirs = data["answer_generation"]["function"]
        ours = [openai_tool_schema(a)["function"] for a in by_id[qid].api_list] + [finish_tool_schema()["function"]]
        assert [f["name"] for f in theirs] == [f["name"] for f in ours], path.name
        assert theirs == ours, path.name  # the whole schema, field for field
        checked_functions += len(theirs)
        all_built.update(f["name"] for f in ours)
        called: set[str] = set()
        _walk_names(data, called)
        assert called <= {f["name"] for f in ours}, (path.name, called - {f["name"] for f in ours})
    for path in converted:
        for qid, entry in json.loads(path.read_text()).items():
            ours = [openai_tool_schema(a)["function"] for a in by_id[int(qid)].api_list] + [finish_tool_schema()["function"]]
            assert entry["available_tools"] == ours, (path.name, qid)
            called = set()
            _walk_names(entry["answer"], called)
            assert called <= all_built
    assert checked_functions >= 40
