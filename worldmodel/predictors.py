"""Intention predictors: the trained encoder, and the ablation baselines of the paper's Table 3."""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from intent.errors import UsageError
from intent.logs import label_of
from worldmodel.formats import FORMAT_VERSION, PREDICTOR_LABELS, predictor_text
from worldmodel.protocols import ModelError, PredictorInput

__all__ = ["EmpiricalMeanPredictor", "EncoderIntentionPredictor", "HashedLogisticPredictor", "OptimisticPredictor",
           "ToolTokenFrequencyPredictor"]


class OptimisticPredictor:
    """Ablation "Optimistic": p = 1 for every call (expected cost = price)."""

    name = "optimistic"

    def predict(self, reasoning: str, tool: str, args: Mapping[str, Any]) -> float:
        return 1.0

    def predict_batch(self, items: Sequence[PredictorInput]) -> list[float]:
        return [1.0] * len(items)


class EmpiricalMeanPredictor:
    """Ablation "Empirical Mean": each tool's observed success frequency, ignoring the reasoning.

    p(tool) = (successes + prior_strength * m) / (calls + prior_strength), where m is the mean
    over all labelled calls (so an unseen tool gets m). Labels come from ``labeler`` (z).
    """

    name = "empirical_mean"

    def __init__(self, records: Iterable[Any] = (), *, labeler: Callable[[Any], int | None] = label_of,
                 prior_strength: float = 2.0, default: float = 0.5) -> None:
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for r in records:
            z = labeler(r)
            if z is None:
                continue
            tool = r["tool"] if isinstance(r, Mapping) else r.tool
            counts[tool][0] += z
            counts[tool][1] += 1
        total = sum(c[1] for c in counts.values())
        self.mean = sum(c[0] for c in counts.values()) / total if total else default
        self.prior_strength = prior_strength
        self.table = {t: (s + prior_strength * self.mean) / (n + prior_strength) for t, (s, n) in counts.items()}

    def predict(self, reasoning: str, tool: str, args: Mapping[str, Any]) -> float:
        return self.table.get(tool, self.mean)

    def predict_batch(self, items: Sequence[PredictorInput]) -> list[float]:
        return [self.table.get(tool, self.mean) for _, tool, _ in items]


class EncoderIntentionPredictor:
    """An encoder with a classification head (HF directory) plus its fitted temperature.

    ``calibrated=False`` is the "Uncalibrated" ablation (temperature 1). The directory is what
    ``intent train predictor`` saves: ``config.json``, weights, tokenizer, ``calibration.json``.
    ``max_length`` (tokens per input) defaults to the one the model was trained with (recorded in
    ``calibration.json``; 256 for a file written before it was recorded).
    """

    name = "encoder"

    def __init__(self, model_dir: str | Path, *, calibrated: bool = True, device: str = "cpu",
                 batch_size: int = 32, max_length: int | None = None) -> None:
        try:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as exc:  # pragma: no cover - exercised only without the ml extra
            raise ImportError("EncoderIntentionPredictor needs torch and transformers: run `make install` "
                              "or `pip install -e .[ml]`") from exc
        path = Path(model_dir)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json); "
                                    "pass the output directory of `intent train predictor`")
        calibration_file = path / "calibration.json"
        if not calibration_file.is_file():
            # A base encoder's directory (config.json, weights) loads too, with an untrained head.
            raise UsageError(f"{path} has no calibration.json: it is not an `intent train predictor` output (a base "
                             "encoder's classification head is untrained); train one and pass its --out directory")
        calibration = json.loads(calibration_file.read_text())
        if calibration.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise UsageError(f"{calibration_file}: format_version {calibration.get('format_version')} != "
                             f"{FORMAT_VERSION}; retrain with this version of worldmodel/formats.py")
        self.temperature = float(calibration.get("temperature", 1.0)) if calibrated else 1.0
        if max_length is None:
            max_length = int(calibration.get("max_length", 256))
        self._torch = torch
        from worldmodel.hf_progress import hide_hf_progress_bars_off_a_tty

        hide_hf_progress_bars_off_a_tty()  # transformers' "Loading weights" bar, in a benchmark's log
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        self._satisfied = _satisfied_index(path, self.model.config)
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self._lock = threading.Lock()  # one forward pass at a time on a shared model

    def predict(self, reasoning: str, tool: str, args: Mapping[str, Any]) -> float:
        return self.predict_batch([(reasoning, tool, args)])[0]

    def predict_batch(self, items: Sequence[PredictorInput]) -> list[float]:
        return self.probabilities(self.logits(items))

    def logits(self, items: Sequence[PredictorInput], *, on_batch: Callable[[int], Any] | None = None) -> Any:
        """The head's raw logits (a tensor, one row per item); ``on_batch(n)`` after each batch of ``n``."""
        torch = self._torch
        texts = [predictor_text(r, t, a) for r, t, a in items]
        out = []
        try:
            with self._lock, torch.no_grad():
                for i in range(0, len(texts), self.batch_size):
                    enc = self.tokenizer(texts[i:i + self.batch_size], padding=True, truncation=True,
                                         max_length=self.max_length, return_tensors="pt").to(self.device)
                    out.append(self.model(**enc).logits)
                    if on_batch is not None:
                        on_batch(len(out[-1]))
        except RuntimeError as exc:
            raise ModelError(f"intention predictor failed: {exc}") from exc
        return torch.cat(out) if out else torch.zeros((0, 2))

    def probabilities(self, logits: Any, *, calibrated: bool = True) -> list[float]:
        """p(z = 1) from :meth:`logits`: divided by the temperature (``calibrated``), then softmax. One
        forward pass gives both the calibrated and the raw p (``intent train report`` scores both)."""
        scaled = logits / self.temperature if calibrated else logits
        return self._torch.softmax(scaled, dim=-1)[:, self._satisfied].tolist()


def _satisfied_index(path: Path, config: Any) -> int:
    """The head's class for z = 1, by its name in ``config.json``'s ``id2label`` (a head saved with its classes in
    another order, or re-labelled by hand, is read by name, not by position)."""
    labels = {int(i): str(name) for i, name in (getattr(config, "id2label", None) or {}).items()}
    if sorted(labels) != [0, 1]:
        raise UsageError(f"{path}: the classification head has {len(labels)} classes ({labels}); an intention "
                         f"predictor has two, {PREDICTOR_LABELS}: train it with `intent train predictor`")
    by_name = {name: i for i, name in labels.items()}
    if set(by_name) == set(PREDICTOR_LABELS):
        return by_name["satisfied"]
    if set(by_name) == {"LABEL_0", "LABEL_1"}:  # exported before the classes were named: 1 was z = 1
        return 1
    raise UsageError(f"{path}: config.json's id2label {labels} names no {PREDICTOR_LABELS} classes; set it to "
                     f"{dict(enumerate(PREDICTOR_LABELS))} if class 1 means the call satisfies the intention")


class HashedLogisticPredictor:
    """A light trained predictor: L2-regularised logistic regression on hashed features, numpy only.

    Features of ``(reasoning, tool, args)`` (all binary, hashed into ``n_features`` buckets):

    * word unigrams and bigrams of :func:`worldmodel.formats.predictor_text` (what the agent
      wants and the call);
    * the tool's name and each of its name's tokens (``geo_lite_geocode`` -> geo, lite, geocode):
      the provider tier is in the name;
    * the tool crossed with each argument value (``tool|key=value``): a provider's quality can
      depend on the query (which entity, which region) and a linear model over words alone
      cannot express "this provider, this kind of argument".

    The call's own features count 1 each; the text's n-grams share unit norm as one block.
    Training is full-batch Adam on a sparse design matrix (a few thousand rows here). When
    ``groups`` (task ids) are given, ``dev_fraction`` of the **tasks** is held out: the L2
    strength is chosen on them by NLL (from ``l2_grid``) and the temperature is fitted on them
    (Guo et al., 2017). The temperature is kept only if it lowers the held-out NLL without raising
    the held-out ECE, so calibration never makes the model worse on the tasks it was fitted on, and
    only when they hold ``min_calibration_examples`` calls (one scalar fitted on ~90 calls overfits:
    seen here, T = 2.4 doubled the test ECE). An isotonic map after the temperature is kept on the
    same terms, judged out of sample by cross-fitting over the held-out tasks, when they hold
    ``min_isotonic_examples`` calls (temperature scaling
    cannot fix a predictor too low at one end and too high in the middle). Without groups, the
    held-out split is by record (each record its own task) and the fit says so in ``split``.

    ``calibrated=False`` gives the "Uncalibrated" ablation.
    """

    name = "hashed_logistic"

    def __init__(self, *, n_features: int = 2**15, l2: float | None = None,
                 l2_grid: Sequence[float] = (1e-4, 1e-3, 1e-2), epochs: int = 300, lr: float = 0.1,
                 seed: int = 0, min_calibration_examples: int = 200,
                 isotonic_blocks: Sequence[int] = (20, 40, 80), min_isotonic_examples: int = 500) -> None:
        if epochs < 1:
            raise UsageError(f"epochs must be >= 1, got {epochs}")
        self.n_features, self.epochs, self.lr, self.seed = n_features, epochs, lr, seed
        self.min_calibration_examples = min_calibration_examples
        self.isotonic_blocks = tuple(isotonic_blocks)
        # A map of several knots needs more held-out calls than one temperature: each half of the
        # cross-fit must still hold a few blocks of 80.
        self.min_isotonic_examples = min_isotonic_examples
        self.l2_grid = tuple(l2_grid) if l2 is None else (float(l2),)
        self.l2: float | None = l2
        self.weights: Any = None
        self.bias = 0.0
        self.temperature = 1.0
        self.isotonic: tuple[list[float], list[float]] | None = None  # knots (p, rate), see fit
        self.calibrated = True
        self.split: dict[str, Any] = {}

    # -- features -------------------------------------------------------------------------------------------
    @staticmethod
    def feature_names(reasoning: str, tool: str, args: Mapping[str, Any] | str) -> set[str]:
        text = predictor_text(reasoning, tool, args)
        words = [w for w in "".join(c.lower() if c.isalnum() else " " for c in text).split() if w]
        names = {"w:" + w for w in words} | {"b:" + a + "_" + b for a, b in zip(words, words[1:])}
        tool_l = (tool or "").lower()
        names.add("t:" + tool_l)
        names |= {"tw:" + w for w in "".join(c if c.isalnum() else " " for c in tool_l).split()}
        if isinstance(args, Mapping):
            for key, value in args.items():
                v = " ".join(str(value).lower().split())
                names.add(f"ta:{tool_l}|{key}={v}")
        return names

    def _matrix(self, items: Sequence[PredictorInput]) -> tuple[Any, Any, Any]:
        """A CSR-like sparse matrix (indptr, cols, vals)."""
        import zlib

        import numpy as np

        indptr, cols, vals = [0], [], []
        for reasoning, tool, args in items:
            # Two blocks of equal weight: the call's own features (tool, name tokens, tool x argument)
            # at 1 each, and the free text's n-grams scaled to unit norm together, so that forty words
            # of reasoning do not drown the few features that say which provider is called.
            row: dict[int, float] = {}
            names = self.feature_names(reasoning, tool, args)
            text = [f for f in names if f[:2] in ("w:", "b:")]
            for f in names:
                j = zlib.crc32(f.encode()) % self.n_features
                row[j] = row.get(j, 0.0) + (1.0 / len(text) ** 0.5 if f[:2] in ("w:", "b:") else 1.0)
            idx = sorted(row)
            cols += idx
            vals += [row[j] for j in idx]
            indptr.append(len(cols))
        return np.asarray(indptr), np.asarray(cols, dtype=np.int64), np.asarray(vals, dtype=float)

    @staticmethod
    def _dot(m: tuple[Any, Any, Any], w: Any, b: float) -> Any:
        import numpy as np

        indptr, cols, vals = m
        prod = np.concatenate([w[cols] * vals, [0.0]])
        sums = np.add.reduceat(prod, indptr[:-1]) if len(cols) else np.zeros(len(indptr) - 1)
        sums[indptr[:-1] == indptr[1:]] = 0.0  # rows without features (reduceat would repeat a value)
        return sums + b

    def _train(self, m: tuple[Any, Any, Any], y: Any, l2: float) -> tuple[Any, float]:
        import numpy as np

        from worldmodel.calibration import sigmoid

        indptr, cols, vals = m
        rows = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
        n = len(y)
        w = np.zeros(self.n_features)
        prior = float(np.clip(y.mean(), 1e-3, 1 - 1e-3))
        b = float(np.log(prior / (1 - prior)))
        mw, vw = np.zeros_like(w), np.zeros_like(w)
        mb = vb = 0.0
        beta1, beta2, eps = 0.9, 0.999, 1e-8
        for t in range(1, self.epochs + 1):
            grad = sigmoid(self._dot(m, w, b)) - y
            gw = np.bincount(cols, weights=vals * grad[rows], minlength=self.n_features) / n + l2 * w
            gb = float(grad.mean())
            mw = beta1 * mw + (1 - beta1) * gw
            vw = beta2 * vw + (1 - beta2) * gw * gw
            mb = beta1 * mb + (1 - beta1) * gb
            vb = beta2 * vb + (1 - beta2) * gb * gb
            corr1, corr2 = 1 - beta1 ** t, 1 - beta2 ** t
            w -= self.lr * (mw / corr1) / (np.sqrt(vw / corr2) + eps)
            b -= self.lr * (mb / corr1) / (np.sqrt(vb / corr2) + eps)
        return w, b

    # -- fit / predict ----------------------------------------------------------------------------------------
    def fit(self, items: Sequence[PredictorInput], labels: Sequence[int], *, groups: Sequence[str] | None = None,
            dev_fraction: float = 0.2) -> HashedLogisticPredictor:
        """Fit on ``items``; ``groups`` (one task id per item) makes the held-out split by task."""
        import random

        import numpy as np

        from worldmodel.calibration import ece, fit_temperature, nll, sigmoid

        if len(items) != len(labels) or (groups is not None and len(groups) != len(items)):
            raise UsageError(f"items ({len(items)}), labels ({len(labels)}) and groups "
                             f"({'none' if groups is None else len(groups)}) must have one entry per call")
        y = np.asarray(labels, dtype=float)
        if len(set(y.tolist())) < 2:
            raise UsageError("the intention labels are all one class; a predictor needs both z=0 and z=1 examples")
        keys = [str(g) for g in groups] if groups is not None else [str(i) for i in range(len(items))]
        tasks = sorted(set(keys))
        random.Random(self.seed).shuffle(tasks)
        n_dev_tasks = int(round(len(tasks) * dev_fraction)) if len(tasks) >= 5 else 0
        dev_tasks = set(tasks[:n_dev_tasks])
        dev = np.asarray([k in dev_tasks for k in keys])
        if n_dev_tasks and len(set(y[dev].tolist())) < 2:
            dev[:] = False  # a held-out split of one class can neither choose L2 nor calibrate
        m_all = self._matrix(items)

        def rows(mask: Any) -> tuple[Any, Any, Any]:
            sel = np.flatnonzero(mask)
            return self._matrix([items[i] for i in sel])

        m_train = rows(~dev) if dev.any() else m_all
        y_train = y[~dev] if dev.any() else y
        if len(set(y_train.tolist())) < 2:
            m_train, y_train, dev[:] = m_all, y, False
        best = None
        if dev.any() and len(self.l2_grid) > 1:
            m_dev = rows(dev)
            for l2 in self.l2_grid:
                w, b = self._train(m_train, y_train, l2)
                score = nll(sigmoid(self._dot(m_dev, w, b)), y[dev].astype(int))
                if best is None or score < best[0]:
                    best = (score, l2, w, b)
            _, self.l2, self.weights, self.bias = best
        else:
            self.l2 = self.l2_grid[0] if self.l2 is None else self.l2
            self.weights, self.bias = self._train(m_train, y_train, self.l2)
        self.temperature = 1.0
        self.isotonic = None
        dev_metrics: dict[str, float] = {}
        if dev.any():
            logits = self._dot(rows(dev), self.weights, self.bias)
            y_dev = y[dev].astype(int)
            t = fit_temperature(logits, y_dev)
            before, after = sigmoid(logits), sigmoid(logits / t)
            # Kept only if it helps on the held-out tasks by both measures: scaling never makes the
            # model worse there (it cannot promise that on tasks it has not seen).
            if (len(y_dev) >= self.min_calibration_examples and nll(after, y_dev) < nll(before, y_dev)
                    and ece(after, y_dev) <= ece(before, y_dev)):
                self.temperature = t
            scaled = sigmoid(logits / self.temperature)
            dev_metrics = {"dev_nll_unscaled": nll(before, y_dev), "dev_ece_unscaled": ece(before, y_dev)}
            if len(y_dev) >= self.min_isotonic_examples:
                dev_metrics |= self._fit_isotonic(scaled, y_dev, [keys[i] for i in np.flatnonzero(dev)])
            final = self.calibrate(logits)
            dev_metrics |= {"dev_nll": nll(final, y_dev), "dev_ece": ece(final, y_dev)}
        self.split = {"by": "task" if groups is not None else "record", "train_tasks": len(tasks) - len(dev_tasks),
                      "dev_tasks": len(dev_tasks) if dev.any() else 0, "train_examples": int(len(y_train)),
                      "dev_examples": int(dev.sum()), "l2": self.l2, "temperature": self.temperature,
                      "calibration": self.calibration_kind, **dev_metrics}
        return self

    def _fit_isotonic(self, scaled: Any, y_dev: Any, dev_keys: Sequence[str]) -> dict[str, float]:
        """Isotonic calibration on the held-out tasks, kept only if it wins there *out of sample*:
        the held-out tasks are cut in two, each half is calibrated on the other, and the
        map is kept if that cross-fitted result has a lower NLL and no higher ECE than without it.
        (Fitted and scored on the same calls, isotonic regression would always look better.) The
        knots' smallest block is chosen from ``isotonic_blocks`` by the same cross-fitted ECE."""
        import random

        import numpy as np

        from worldmodel.calibration import apply_isotonic, ece, fit_isotonic, nll

        halves = sorted(set(dev_keys))
        random.Random(self.seed + 1).shuffle(halves)
        first = set(halves[: len(halves) // 2])
        fold = np.asarray([k in first for k in dev_keys])
        if any(len(set(y_dev[fold == side].tolist())) < 2 for side in (True, False)):
            return {}
        best: tuple[float, float, int] | None = None  # (cross-fitted ECE, NLL, block size)
        for block in self.isotonic_blocks:  # the smallest block a knot may rest on, chosen here too
            cross = np.empty_like(scaled)
            for side in (True, False):
                fit_on = fold == side
                xs, ys = fit_isotonic(scaled[fit_on], y_dev[fit_on], min_block=block)
                cross[~fit_on] = apply_isotonic(scaled[~fit_on], xs, ys)
            scored = (ece(cross, y_dev), nll(cross, y_dev), block)
            if best is None or scored[:2] < best[:2]:
                best = scored
        assert best is not None
        out = {"dev_ece_isotonic_crossfit": best[0], "dev_nll_isotonic_crossfit": best[1],
               "isotonic_min_block": best[2]}
        if best[1] < nll(scaled, y_dev) and best[0] <= ece(scaled, y_dev):
            self.isotonic = fit_isotonic(scaled, y_dev, min_block=best[2])
        return out

    @property
    def calibration_kind(self) -> str:
        """``isotonic`` (after the temperature), ``temperature`` or ``none``."""
        if self.isotonic is not None:
            return "isotonic"
        return "temperature" if self.temperature != 1.0 else "none"

    def calibrate(self, logits: Any) -> Any:
        """Probabilities from logits: the temperature, then the isotonic map when one was kept."""
        from worldmodel.calibration import apply_isotonic, sigmoid

        p = sigmoid(logits / self.temperature)
        return p if self.isotonic is None else apply_isotonic(p, *self.isotonic)

    def logits(self, items: Sequence[PredictorInput]) -> Any:
        if self.weights is None:
            raise UsageError("HashedLogisticPredictor is not fitted; call fit(items, labels) first")
        return self._dot(self._matrix(items), self.weights, self.bias)

    def predict(self, reasoning: str, tool: str, args: Mapping[str, Any]) -> float:
        return self.predict_batch([(reasoning, tool, args)])[0]

    def predict_batch(self, items: Sequence[PredictorInput]) -> list[float]:
        from worldmodel.calibration import sigmoid

        if not items:
            return []
        logits = self.logits(items)
        return [float(v) for v in (self.calibrate(logits) if self.calibrated else sigmoid(logits))]


class ToolTokenFrequencyPredictor:
    """Baseline "per-tool-name-token frequency": each token of the tool's name (``geo_lite_geocode``
    -> geo, lite, geocode) has a smoothed success frequency over the labelled calls whose tool
    names contain it; a call's p is the mean over its name's tokens (the overall mean for unseen ones).

    It generalises across tools that share a tier word, which the per-tool count cannot.
    """

    name = "tool_token_frequency"

    def __init__(self, records: Iterable[Any] = (), *, labeler: Callable[[Any], int | None] = label_of,
                 prior_strength: float = 2.0, default: float = 0.5) -> None:
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        total = [0, 0]
        for r in records:
            z = labeler(r)
            if z is None:
                continue
            tool = r["tool"] if isinstance(r, Mapping) else r.tool
            for tok in _name_tokens(tool):
                counts[tok][0] += z
                counts[tok][1] += 1
            total[0] += z
            total[1] += 1
        self.mean = total[0] / total[1] if total[1] else default
        self.table = {t: (s + prior_strength * self.mean) / (n + prior_strength) for t, (s, n) in counts.items()}

    def predict(self, reasoning: str, tool: str, args: Mapping[str, Any]) -> float:
        toks = [t for t in _name_tokens(tool) if t in self.table]
        return sum(self.table[t] for t in toks) / len(toks) if toks else self.mean

    def predict_batch(self, items: Sequence[PredictorInput]) -> list[float]:
        return [self.predict(r, t, a) for r, t, a in items]


def _name_tokens(tool: str) -> list[str]:
    return list(dict.fromkeys("".join(c if c.isalnum() else " " for c in (tool or "").lower()).split()))
