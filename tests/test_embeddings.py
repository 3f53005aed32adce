"""The one embedding module (baselines.embeddings) that BTP's experience and StableToolBench retrieval share."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

import baselines.btp.experience as btp_experience
import eval.stabletoolbench as stb
from baselines.embeddings import MiniLMEmbedder, TfidfEmbedder, l2_normalize, tokens


def test_btp_and_retrieval_use_the_same_classes():
    assert btp_experience.TfidfEmbedder is stb.TfidfEmbedder is TfidfEmbedder
    assert btp_experience.MiniLMEmbedder is stb.MiniLMEmbedder is MiniLMEmbedder
    # BTP's default embedder is the shared TF-IDF, fitted on the store's queries
    store = btp_experience.ExperienceStore([btp_experience.Usage("weather in oslo", "w", {}, "", 1, 1)])
    assert type(store.default_embedder()) is TfidfEmbedder


def test_tfidf_formula_by_hand():
    # Sublinear TF (1 + log count) times smoothed IDF (log((1 + n) / (1 + df)) + 1), rows L2-normalised.
    emb = TfidfEmbedder().fit(["weather Oslo", "weather Rome"])
    assert emb.vocabulary == {"oslo": 0, "rome": 1, "weather": 2}
    idf_city, idf_weather = math.log(3 / 2) + 1, math.log(3 / 3) + 1
    row = emb.encode(["weather weather oslo"])[0]
    expected = np.array([1.0 * idf_city, 0.0, (1 + math.log(2)) * idf_weather])
    assert np.allclose(row, expected / np.linalg.norm(expected), atol=1e-6)


def test_tokens_split_camel_case_and_drop_stop_words():
    assert tokens("Get the PopularSitesForQuery API, please") == ["popular", "sites", "query"]


def test_tfidf_needs_fitting_and_unknown_text_is_zero():
    with pytest.raises(RuntimeError, match="before fit"):
        TfidfEmbedder().encode(["x"])
    emb = TfidfEmbedder().fit(["weather forecast"])
    assert np.allclose(emb.encode(["zzz"]), 0.0)
    with pytest.raises(ValueError, match="max_features"):
        TfidfEmbedder(max_features=0)


def test_l2_normalize_rejects_non_matrices():
    with pytest.raises(ValueError, match="2-D"):
        l2_normalize(np.ones(3))
    assert np.allclose(np.linalg.norm(l2_normalize(np.array([[3.0, 4.0], [0.0, 0.0]])), axis=1), [1.0, 0.0])


def test_importing_the_module_does_not_import_torch():
    code = "import sys, baselines.embeddings; print('torch' in sys.modules or 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
