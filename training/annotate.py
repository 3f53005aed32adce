"""Label z ("did the call satisfy the intention stated in the reasoning?") on interaction logs.

``ground_truth``: from the environment's artifact (the synthetic market records it).
``llm``: an LLM judge through any OpenAI-compatible endpoint, with the prompt of
:mod:`worldmodel.formats`, majority of ``votes`` answers. The output is the same JSONL with a
``z`` field added (StepRecord keeps extra fields).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from intent.errors import UsageError
from intent.logs import StepRecord, label_of
from worldmodel.formats import JUDGE_SYSTEM, judge_prompt, parse_judge

__all__ = ["LLM_NEEDS_JUDGE", "LLMJudge", "annotate"]


LLM_NEEDS_JUDGE = ("--method llm needs --judge-url (an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1) "
                   "and --judge-model (the model it serves)")


class LLMJudge:
    def __init__(self, base_url: str, model: str, *, api_key: str = "EMPTY", votes: int = 3, timeout: float = 60,
                 temperature: float = 0.7) -> None:
        import httpx

        from worldmodel.endpoints import check_model

        if votes < 1 or votes % 2 == 0:
            raise UsageError(f"--votes must be an odd number >= 1 (a majority), got {votes}")
        # The model too, not only the server: was a 404 traceback from httpx at the first call to label.
        check_model(base_url, model, api_key=api_key, flag="--judge-model ", url_flag="--judge-url")
        self.base_url = base_url
        self.model, self.votes, self.temperature = model, votes, temperature
        self._client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout,
                                    headers={"Authorization": f"Bearer {api_key}"})

    def label(self, record: StepRecord) -> int | None:
        prompt = judge_prompt(record.reasoning, record.tool, record.args, record.observation)
        votes = []
        for _ in range(self.votes):
            r = self._client.post("/chat/completions", json={
                "model": self.model, "temperature": self.temperature, "max_tokens": 64,
                "messages": [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": prompt}]})
            if 400 <= r.status_code < 500 and r.status_code != 429:
                # The request itself is refused (model, path, key): every other call would be too.
                raise UsageError(f"the judge at --judge-url {self.base_url} refused the request for --judge-model "
                                 f"{self.model}: HTTP {r.status_code} {r.text[:200]}; check both flags")
            r.raise_for_status()
            vote = parse_judge(r.json()["choices"][0]["message"]["content"])
            if vote is not None:
                votes.append(vote)
        if not votes:
            return None
        (top, n), *rest = Counter(votes).most_common()
        return top if not rest or rest[0][1] < n else None


def annotate(records: list[StepRecord], out_path: str | Path, *, method: str = "ground_truth",
             judge: LLMJudge | None = None) -> dict[str, Any]:
    if method not in ("ground_truth", "llm"):
        raise UsageError(f"annotation method must be ground_truth or llm, got {method!r}")
    if method == "llm" and judge is None:
        raise UsageError(LLM_NEEDS_JUDGE)
    counts: Counter[str] = Counter()
    out = Path(out_path)
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give the labelled log's file name, e.g. {out / 'labelled.jsonl'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        for r in records:
            data = json.loads(r.model_dump_json())
            if r.decision == "accept" and r.status in ("ok", "error") and r.kind == "tool":
                if method == "ground_truth":
                    # The environment's label only: an older annotation in the file is replaced.
                    z = label_of(r, ground_truth_only=True)
                else:
                    z = judge.label(r)  # type: ignore[union-attr]
                data["z"] = z
                counts["labelled" if z is not None else "unlabelled"] += 1
            fh.write(json.dumps(data) + "\n")
    if counts["labelled"] == 0:
        raise UsageError("no call could be labelled: the logs carry no ground truth (artifact z); use --method llm")
    return dict(counts)
