"""Schema-simulated StableToolBench environment: determinism, error paths, truncation, grammar."""

from __future__ import annotations

import json

import pytest

from eval.stabletoolbench import (
    PayloadFiller,
    SchemaSimulator,
    StbApi,
    ToolEnvironment,
    StbDataError,
    api_pool,
    load_queries,
    recover_truncated_json,
    resolve_root,
    truncate_observation,
)
from eval.stabletoolbench.loader import Param
from eval.stabletoolbench.payload import classify_template

CONCERT = StbApi(
    category="Data",
    tool_name="TheClique",
    api_name="Songkick concert",
    description="Concert info",
    required=(Param("id_conc", "string", "", "40698227"),),
    optional=(Param("ID", "NUMBER", "", ""),),
    template_response={
        "name": "str",
        "id_conc": "str",
        "fans": "int",
        "score": "float",
        "on_tour": "bool",
        "nothing": "NoneType",
        "empty": "empty list",
        "line_up": [{"link": "str", "name": "str", "_list_length": 3}],
        "posters": ["list of str with length 4"],
        "years": ["list of int with length 2"],
    },
)
OTHER = StbApi("Data", "TheClique", "Songkick artist", "Artist info", (), ())
TEXT = StbApi("Data", "Text Tool", "Say", "", (), (), template_response="just some plain words")
CUT = StbApi(
    "Data", "Cut Tool", "Cut", "", (), (),
    template_response='{"a": "str", "b": [{"c": "int", "_list_length": 2}], "d": {"e": "float", "f": "st',
)


@pytest.fixture()
def sim() -> SchemaSimulator:
    return SchemaSimulator([CONCERT, OTHER, TEXT, CUT])


def _payload(result) -> dict:
    data = json.loads(result.observation)
    assert set(data) == {"error", "response"}
    return data


def test_success_fills_grammar(sim) -> None:
    r = sim.call("songkick_concert_for_theclique", '{"id_conc": "abc-123", "is_id": 4}')
    assert r.ok and r.status_code == 0 and r.error == "" and r.environment == "schema-simulated"
    assert isinstance(sim, ToolEnvironment)
    resp = _payload(r)["response"]
    assert resp["id_conc"] == "abc-123"  # echoes the argument where the key matches
    assert isinstance(resp["name"], str) and isinstance(resp["fans"], int)
    assert isinstance(resp["score"], float) and isinstance(resp["on_tour"], bool)
    assert resp["nothing"] is None and resp["empty"] == []
    assert len(resp["line_up"]) == 3 and set(resp["line_up"][0]) == {"link", "name"}
    assert len(resp["posters"]) == 4 and all(isinstance(x, str) for x in resp["posters"])
    assert len(resp["years"]) == 2 and all(isinstance(x, int) for x in resp["years"])


def test_deterministic_per_function_and_canonical_args(sim) -> None:
    a = sim.call("songkick_concert_for_theclique", '{"id_conc": "x", "is_id": 1}')
    b = sim.call("songkick_concert_for_theclique", '{"is_id": 1,   "id_conc": "x"}')
    c = SchemaSimulator([CONCERT]).call("songkick_concert_for_theclique", {"id_conc": "x", "is_id": 1})
    d = sim.call("songkick_concert_for_theclique", '{"id_conc": "y", "is_id": 1}')
    assert a == b == c
    assert a.observation != d.observation


def test_parse_error(sim) -> None:
    r = sim.call("songkick_concert_for_theclique", "{not json")
    assert _payload(r) == {"error": "Tool input parse error...\n", "response": ""}
    assert not r.ok and r.status_code == 0  # upstream's client maps no code for this error
    assert not sim.call("songkick_concert_for_theclique", "[1, 2]").ok


def test_empty_string_is_empty_dict(sim) -> None:
    assert sim.call("songkick_artist_for_theclique", "").ok
    r = sim.call("songkick_concert_for_theclique", "")
    assert "missing 1 required positional argument: 'id_conc'" in r.error


def test_unknown_function(sim) -> None:
    r = sim.call("made_up_for_nothing", "{}")
    assert r.observation == '{"error": "No such function name: made_up_for_nothing", "response": ""}'
    assert r.status_code == 1 and not r.ok


def test_endswith_resolution(sim) -> None:
    # upstream resolves to the FIRST function whose name ends with the called name
    r = sim.call("concert_for_theclique", '{"id_conc": "x"}')
    assert r.ok and r == sim.call("songkick_concert_for_theclique", '{"id_conc": "x"}')
    assert sim.resolve("_for_theclique") is CONCERT


def test_unexpected_keyword(sim) -> None:
    r = sim.call("songkick_concert_for_theclique", '{"id_conc": "x", "abdc": 11123}')
    assert r.error == (
        "Function executing from toolenv.tools.Data.theclique.api import songkick_concert error...\n"
        "songkick_concert() got an unexpected keyword argument 'abdc'"
    )
    assert _payload(r)["response"] == "" and not r.ok
    # raw (unstandardized) parameter names are unexpected too
    assert "unexpected keyword argument 'ID'" in sim.call("songkick_concert_for_theclique", {"id_conc": "x", "ID": 1}).error


def test_missing_required() -> None:
    api = StbApi("Data", "T", "Two", "", (Param("a", "STRING"), Param("b", "STRING"), Param("c", "STRING")), ())
    s = SchemaSimulator([api])
    assert s.call("two_for_t", "{}").error.endswith("two() missing 3 required positional arguments: 'a', 'b', and 'c'")
    assert s.call("two_for_t", '{"a": 1}').error.endswith("missing 2 required positional arguments: 'b' and 'c'")
    assert s.call("two_for_t", '{"a": 1, "b": 2, "c": 3}').ok


def test_finish(sim) -> None:
    ok = sim.call("Finish", '{"return_type": "give_answer", "final_answer": "done"}')
    assert ok.status_code == 3 and ok.observation == '{"response":"successfully giving the final answer."}'
    assert sim.call("Finish", '{"return_type": "give_up_and_restart"}').status_code == 4
    assert sim.call("Finish", '{"final_answer": "x"}').status_code == 2
    assert sim.call("Finish", '{"return_type": "give_answer"}').status_code == 2
    assert sim.call("Finish", '{"return_type": "give_answer", "final_answer": "unterminated').status_code == 3


def test_text_and_recovered_and_generic(sim) -> None:
    assert classify_template(TEXT.template_response).kind == "text"
    assert isinstance(_payload(sim.call("say_for_text_tool", "{}"))["response"], str)
    assert classify_template(CUT.template_response).kind == "recovered"
    resp = _payload(sim.call("cut_for_cut_tool", "{}"))["response"]
    assert set(resp) == {"a", "b", "d"} and len(resp["b"]) == 2 and isinstance(resp["d"]["e"], float)
    generic = _payload(sim.call("songkick_artist_for_theclique", "{}"))["response"]
    assert generic["status"] == "success" and generic["results"]


def test_recover_truncated_json() -> None:
    assert recover_truncated_json('{"a": 1}') == {"a": 1}
    assert recover_truncated_json('{"a": 1, "b": [1, 2, {"c": "x"}, {"d": "tr') == {"a": 1, "b": [1, 2, {"c": "x"}]}
    assert recover_truncated_json('{"a": {"b": "str", "c": "in') == {"a": {"b": "str"}}
    assert recover_truncated_json('{"a": {"b') == {"a": {}}
    assert recover_truncated_json("plain text") is None


def test_list_cap() -> None:
    api = StbApi("D", "T", "L", "", (), (), template_response={"xs": [{"v": "int", "_list_length": 500}]})
    resp = json.loads(SchemaSimulator([api], filler=PayloadFiller(max_list_items=5)).call("l_for_t", "").observation)
    assert len(resp["response"]["xs"]) == 5


def test_truncation_at_1024() -> None:
    assert truncate_observation("x" * 1024) == "x" * 1024
    assert truncate_observation("x" * 1025) == "x" * 1024 + "..."
    api = StbApi("D", "T", "Big", "", (), (), template_response={f"text_{i}": "str" for i in range(40)})
    r = SchemaSimulator([api]).call("big_for_t", "{}")
    assert r.ok and len(r.observation) == 1027 and r.observation.endswith("...")


def test_every_pool_api_simulates() -> None:
    try:
        resolve_root()
    except StbDataError as exc:
        pytest.skip(f"StableToolBench data not available: {exc}")
    pool = api_pool(load_queries())
    sim = SchemaSimulator(pool)
    kinds: dict[str, int] = {}
    for api in pool:
        kinds[classify_template(api.template_response).kind] = kinds.get(classify_template(api.template_response).kind, 0) + 1
        args = json.dumps({p.schema_name: p.default for p in api.required})
        r = sim._call_api(api, args)
        assert r.ok, (api.function_name, r.error)
        assert len(r.observation) <= 1027
        json.loads(r.observation if not r.observation.endswith("...") else '{"error": "", "response": ""}')
    assert kinds == {"schema": 1447, "recovered": 149, "generic": 883}
