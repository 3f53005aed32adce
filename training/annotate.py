"""Label z ("did the call satisfy the intention stated in the reasoning?") on interaction logs.

``ground_truth``: from the environment's artifact (the synthetic market records it).
``llm``: an LLM judge through any OpenAI-compatible endpoint, with the prompt of
:mod:`worldmodel.formats`, majority of ``votes`` answers. The output is the same JSONL with a
``z`` field added (StepRecord keeps extra fields).
"""

from __future__ import annotations

import json
import os
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
                 temperature: float = 0.7, retries: int = 2, backoff: float = 1.0) -> None:
        import httpx

        from worldmodel.endpoints import check_model

        if votes < 1 or votes % 2 == 0:
            raise UsageError(f"--votes must be an odd number >= 1 (a majority), got {votes}")
        # The model too, not only the server: was a 404 traceback from httpx at the first call to label.
        check_model(base_url, model, api_key=api_key, flag="--judge-model ", url_flag="--judge-url")
        self.base_url = base_url
        self.model, self.votes, self.temperature = model, votes, temperature
        self.retries, self.backoff = retries, backoff
        self._client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout,
                                    headers={"Authorization": f"Bearer {api_key}"})

    def label(self, record: StepRecord) -> int | None:
        prompt = judge_prompt(record.reasoning, record.tool, record.args, record.observation)
        votes = []
        for _ in range(self.votes):
            vote = parse_judge(self._answer(prompt))
            if vote is not None:
                votes.append(vote)
        if not votes:
            return None
        (top, n), *rest = Counter(votes).most_common()
        return top if not rest or rest[0][1] < n else None

    def _answer(self, prompt: str) -> str:
        """One judge reply. A timeout, a dropped connection, HTTP 5xx or 429 is asked again (``retries`` times,
        backing off: :func:`worldmodel.openai_compat.post_chat`); then, or for a reply without
        ``choices[0].message.content``, a one-line error naming the judge. (Was: an httpx traceback or a KeyError,
        ending a labelling run of thousands of calls.)"""
        from intent.errors import MalformedModelOutputError, ModelUnreachableError
        from worldmodel.openai_compat import ChatRetriesExhausted, post_chat

        body = {"model": self.model, "temperature": self.temperature, "max_tokens": 64,
                "messages": [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": prompt}]}
        try:
            r = post_chat(self._client, body, retries=self.retries, backoff=self.backoff)
        except ChatRetriesExhausted as exc:
            raise ModelUnreachableError(f"the judge at --judge-url {self.base_url} failed {exc.attempts} times "
                                        f"({exc.detail}); check that it is up, then run the command again") from None
        if r.status_code >= 400:
            # The request itself is refused (model, path, key): every other call would be too.
            raise UsageError(f"the judge at --judge-url {self.base_url} refused the request for --judge-model "
                             f"{self.model}: HTTP {r.status_code} {r.text[:200]}; check both flags")
        try:
            content = r.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise MalformedModelOutputError(
                f"the judge at --judge-url {self.base_url} answered without choices[0].message.content "
                f"({r.text[:200]!r}); is it an OpenAI-compatible chat endpoint?") from exc
        return content if isinstance(content, str) else ""


def annotate(records: list[StepRecord], out_path: str | Path, *, method: str = "ground_truth",
             judge: LLMJudge | None = None, progress: bool = True) -> dict[str, Any]:
    if method not in ("ground_truth", "llm"):
        raise UsageError(f"annotation method must be ground_truth or llm, got {method!r}")
    if method == "llm" and judge is None:
        raise UsageError(LLM_NEEDS_JUDGE)
    counts: Counter[str] = Counter()
    out = Path(out_path)
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give the labelled log's file name, e.g. {out / 'labelled.jsonl'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    from intent.progress import progress as progress_reporter

    def to_label(r: StepRecord) -> bool:
        return r.decision == "accept" and r.status in ("ok", "error") and r.kind == "tool"

    # Written beside OUT and moved over it when complete: a judge that stays down halfway, an interrupt, or logs
    # without any label leave no partial labelled log (and an earlier one at OUT untouched).
    partial = out.with_name(out.name + ".partial")
    try:
        # A judge answers votes x calls requests (hours on a real log): a line at least every 10 s, as the trainers'.
        with open(partial, "w", encoding="utf-8") as fh, \
                progress_reporter(sum(map(to_label, records)), f"labelling z ({method})",
                                  enabled=progress and method == "llm") as bar:
            for r in records:
                data = json.loads(r.model_dump_json())
                if to_label(r):
                    if method == "ground_truth":
                        # The environment's label only: an older annotation in the file is replaced.
                        z = label_of(r, ground_truth_only=True)
                    else:
                        z = judge.label(r)  # type: ignore[union-attr]
                    data["z"] = z
                    counts["labelled" if z is not None else "unlabelled"] += 1
                    bar.update(1)
                fh.write(json.dumps(data) + "\n")
        if counts["labelled"] == 0:
            raise UsageError("no call could be labelled: the logs carry no ground truth (artifact z); use --method llm")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return dict(counts)
