"""StableToolBench loader: counts, pool, path resolution and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.stabletoolbench import GROUPS, StbDataError, api_pool, load_queries, resolve_root
from eval.stabletoolbench.loader import ENV_VAR, default_root

EXPECTED = {
    "G1_instruction": 163,
    "G1_category": 153,
    "G1_tool": 158,
    "G2_instruction": 106,
    "G2_category": 124,
    "G3_instruction": 61,
}


@pytest.fixture(scope="module")
def queries():
    try:
        resolve_root()
    except StbDataError as exc:
        pytest.skip(f"StableToolBench data not available: {exc}")
    return load_queries()


def test_counts_per_group(queries) -> None:
    counts = {g: sum(q.group == g for q in queries) for g in GROUPS}
    assert counts == EXPECTED
    assert len(queries) == 765
    assert len({q.query_id for q in queries}) == 765


def test_pool(queries) -> None:
    pool = api_pool(queries)
    assert len(pool) == 2479
    assert len({a.key for a in pool}) == 2479
    assert len({a.function_name for a in pool}) == 2470  # 6 truncated names are shared
    assert sum(len(a.pure_api_name + "_for_" + a.standard_tool_name) > 64 for a in pool) == 76


def test_relevant_subset_of_api_list(queries) -> None:
    total = 0
    for q in queries:
        assert 1 <= len(q.relevant) <= 6
        keys = {a.key for a in q.api_list}
        assert set(q.relevant) <= keys
        assert len(q.relevant_apis) >= 1
        total += len(q.relevant)
    assert total == 1799


def test_group_selection(queries) -> None:
    g3 = load_queries(groups=["G3_instruction"])
    assert len(g3) == 61 and {q.group for q in g3} == {"G3_instruction"}
    assert len(load_queries(groups="G2_category")) == 124


def test_default_root_is_repo_sibling() -> None:
    repo = Path(__file__).resolve().parents[1]
    assert default_root() == repo.parent / "shared" / "stabletoolbench"


# ------------------------------------------------------------------ errors


def _write_dataset(root: Path, group: str, queries_obj, ids_obj) -> None:
    (root / "solvable_queries" / "test_instruction").mkdir(parents=True)
    (root / "solvable_queries" / "test_query_ids").mkdir(parents=True)
    qtext = queries_obj if isinstance(queries_obj, str) else json.dumps(queries_obj)
    (root / "solvable_queries" / "test_instruction" / f"{group}.json").write_text(qtext)
    (root / "solvable_queries" / "test_query_ids" / f"{group}.json").write_text(json.dumps(ids_obj))


def _query(qid: int = 1, **drop) -> dict:
    q = {
        "query": "find a thing",
        "query_id": qid,
        "api_list": [
            {
                "category_name": "Data",
                "tool_name": "My Tool",
                "api_name": "Get Thing",
                "api_description": "gets a thing",
                "required_parameters": [{"name": "q", "type": "STRING", "description": "", "default": "x"}],
                "optional_parameters": [],
                "method": "GET",
            }
        ],
        "relevant APIs": [["My Tool", "Get Thing"]],
    }
    for k in drop:
        q.pop(k)
    return q


def test_missing_root_names_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(StbDataError) as err:
        load_queries(root=missing)
    msg = str(err.value)
    assert str(missing) in msg and "--stb-path" in msg and ENV_VAR in msg


def test_env_var_resolution(tmp_path: Path, monkeypatch) -> None:
    _write_dataset(tmp_path, "G1_tool", [_query(7)], {"7": 0})
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    qs = load_queries(groups=["G1_tool"])
    assert [q.query_id for q in qs] == [7]
    assert qs[0].api_list[0].function_name == "get_thing_for_my_tool"
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(StbDataError, match=ENV_VAR):
        load_queries(groups=["G1_tool"])


def test_root_without_solvable_queries(tmp_path: Path) -> None:
    with pytest.raises(StbDataError, match="solvable_queries"):
        load_queries(root=tmp_path)


def test_unknown_group_lists_valid(tmp_path: Path) -> None:
    with pytest.raises(StbDataError) as err:
        load_queries(root=tmp_path, groups=["G4_instruction"])
    assert "G4_instruction" in str(err.value)
    for g in GROUPS:
        assert g in str(err.value)


def test_malformed_json_names_file(tmp_path: Path) -> None:
    _write_dataset(tmp_path, "G1_tool", '[{"query": "x", ', {"1": 0})
    with pytest.raises(StbDataError) as err:
        load_queries(root=tmp_path, groups=["G1_tool"])
    assert "G1_tool.json" in str(err.value) and "malformed JSON" in str(err.value)


def test_missing_key_names_file_index_key(tmp_path: Path) -> None:
    _write_dataset(tmp_path, "G1_tool", [_query(1), _query(2, **{"relevant APIs": None})], {"1": 0, "2": 0})
    with pytest.raises(StbDataError) as err:
        load_queries(root=tmp_path, groups=["G1_tool"])
    msg = str(err.value)
    assert "G1_tool.json" in msg and "query index 1" in msg and "'relevant APIs'" in msg


def test_missing_api_key(tmp_path: Path) -> None:
    q = _query(1)
    del q["api_list"][0]["tool_name"]
    _write_dataset(tmp_path, "G1_tool", [q], {"1": 0})
    with pytest.raises(StbDataError, match=r"api_list\[0\].*'tool_name'"):
        load_queries(root=tmp_path, groups=["G1_tool"])


def test_ids_mismatch(tmp_path: Path) -> None:
    _write_dataset(tmp_path, "G1_tool", [_query(1)], {"1": 0, "5": 0})
    with pytest.raises(StbDataError, match="test_query_ids"):
        load_queries(root=tmp_path, groups=["G1_tool"])


def test_missing_group_file(tmp_path: Path) -> None:
    _write_dataset(tmp_path, "G1_tool", [_query(1)], {"1": 0})
    with pytest.raises(StbDataError, match="G2_instruction.json"):
        load_queries(root=tmp_path, groups=["G2_instruction"])
