"""The simulated agent's needs on StableToolBench come from the query text, never from the answer key."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import eval.stabletoolbench as stb
from eval.stabletoolbench import StbDataError, TfidfEmbedder, api_pool, load_queries, resolve_root, retrieve
from eval.stabletoolbench.needs import NeedInference, need_recall, query_clauses


@pytest.fixture(scope="module")
def queries():
    try:
        resolve_root()
    except StbDataError as exc:
        pytest.skip(f"StableToolBench data not available: {exc}")
    return load_queries()


def test_query_clauses():
    assert query_clauses("I'm planning a trip. Can you get the weather and also find hotels? Additionally, "
                         "list flights.") == ["I'm planning a trip", "Can you get the weather", "find hotels",
                                              "list flights"]
    assert query_clauses("  ") == []


def _other_answer_key(q):
    """An answer key that differs from the real one (other APIs of the query, or a made-up one)."""
    others = tuple(a.key for a in q.api_list if a.key not in set(q.relevant))
    return others or (("No Such Tool", "no_such_api"),)


def test_the_agents_view_does_not_depend_on_the_answer_key(queries, tmp_path, monkeypatch):
    from eval.stb_market import StableToolBenchMarket

    real = StableToolBenchMarket(limit=24, out=tmp_path / "real", seed=3)
    loader = stb.load_queries

    def swapped(root=None, groups=None):
        return [replace(q, relevant=_other_answer_key(q)) for q in loader(root, groups)]

    monkeypatch.setattr(stb, "load_queries", swapped)
    altered = StableToolBenchMarket(limit=24, out=tmp_path / "altered", seed=3)
    pairs = list(zip(real.tasks(), altered.tasks(), strict=True))
    assert all(a.query_id == b.query_id and a.relevant != b.relevant for a, b in pairs)
    for a, b in pairs:
        view_a, view_b = real.episode(a, 0).view, altered.episode(b, 0).view
        assert view_a == view_b, a.query_id
        assert view_a.needs and all(n.providers for n in view_a.needs)
    # Only the judge reads the answer key (its closure holds it): the episode a method builder gets as ctx.env
    # carries none.
    assert not hasattr(real.episode(pairs[0][0], 0), "relevant")


def test_needs_inferred_from_real_queries(queries):
    by_id = {q.query_id: q for q in queries}
    chosen = [by_id[11627], by_id[32285]]
    retrieval = retrieve(chosen, api_pool(queries), TfidfEmbedder(), k=20, progress=False)
    inference = NeedInference(TfidfEmbedder().fit([stb.api_document(a) for a in api_pool(queries)]))
    leetcode = inference.infer(by_id[11627].query, retrieval.retrieved_apis[11627])
    # "the name of the Leetcode user ..." and "the word of the day from 'cd'": both found, nothing else
    assert [n.api.function_name for n in leetcode] == ["getname_for_leetcodeapi",
                                                       "word_of_the_day_from_cd_for_word_of_the_day"]
    assert "Leetcode user" in leetcode[0].clause and "word of the day" in leetcode[1].clause
    jokes = {n.api.function_name for n in inference.infer(by_id[32285].query, retrieval.retrieved_apis[32285])}
    assert {"get_joke_of_the_day_for_world_of_jokes", "get_categories_of_jokes_for_world_of_jokes"} <= jokes
    with pytest.raises(ValueError, match="retrieved APIs"):
        inference.infer("anything", [])


def test_need_recall_is_reported(queries, tmp_path):
    from eval.stb_market import StableToolBenchMarket

    market = StableToolBenchMarket(limit=12, out=tmp_path)
    report = json.loads((tmp_path / "retrieval.json").read_text())["agent_needs"]
    assert 0 < report["need_recall"] <= 1 and report["need_recall"] == market.need_recall
    assert len(report["per_query"]) == 12
    assert f"need recall {market.need_recall:.3f}" in market.need_inference_label
    q = market.tasks()[0]
    got = [n.providers[0] for n in market.episode(q, 0).view.needs]
    assert report["per_query"][str(q.query_id)]["recall"] == need_recall(got, q.relevant_function_names)[0]


def test_need_recall_helper():
    assert need_recall(["a", "b"], ["b", "c"]) == (0.5, 0.5)
    assert need_recall([], ["a"]) == (0.0, 0.0)
