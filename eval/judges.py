"""StableToolBench's SoPR judge through any OpenAI-compatible endpoint.

The rules of ``eval_pass_rate.py`` (``ReinforceToolLearningEvaluator``), reimplemented:

1. no final answer (no Finish) -> Unsolved, without an LLM call; an empty answer or a give-up ->
   Unsolved;
2. ``check_answer_status(query, final_answer)`` through a forced function call with an enum
   (Solved / Unsolved / Unsure) and a required reason, temperature 0.2: a sorry or non-positive
   answer is Unsolved; a positive one is Solved or Unsolved when the judge is confident, else Unsure;
3. if Unsure: ``parse_answer_status(query, answer with the tool-call details)``: all calls failed
   -> Unsolved; the answer is not supported by the tool messages -> Unsolved; cannot verify ->
   Unsure; successful calls that solve the query -> Solved;
4. Solved = 1, Unsure = 0.5, Unsolved = 0; ``runs`` independent judgments; the pass rate is the
   mean over runs of each run's average, with the standard deviation over runs.

Unlike upstream, a missing answer counts as a failure (it is not dropped from the denominator).
The prompt wording is ours (the rules are StableToolBench's).

Failures: a reply the judge model got wrong (no forced call, bad JSON, a label outside the enum) is asked
again, and after ``retries`` more attempts counted as Unsure (``malformed`` counts them; the episode's labels
show it). An endpoint that cannot be reached or answers with an HTTP error stops the run
(:class:`JudgeUnavailableError`, naming ``--judge-url``): its finished episodes are saved, and the same
command resumes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from intent.errors import IntentError, UsageError

__all__ = ["JudgeUnavailableError", "SoPRJudge"]


class JudgeUnavailableError(IntentError):
    """The judge's endpoint failed every attempt (down, unreachable, an HTTP error)."""

LABELS = ("Solved", "Unsolved", "Unsure")
SCORES = {"Solved": 1.0, "Unsure": 0.5, "Unsolved": 0.0}

_CHECK = (
    "Decide whether the final answer solves the user's query.\nQuery: {query}\nFinal answer: {answer}\n"
    "Rules: an apology or a non-positive answer (it says it cannot help) is Unsolved. A positive answer is Solved "
    "if you are confident it addresses every part of the query, Unsolved if you are confident it does not, and "
    "Unsure otherwise."
)
_PARSE = (
    "Decide whether the answer solves the query, using the tool calls it made.\nQuery: {query}\n"
    "Answer and tool-call details (JSON): {details}\nRules: if every tool call failed, Unsolved; if the final "
    "answer is not supported by the tool messages, Unsolved; if you cannot verify it, Unsure; if successful "
    "tool calls solve the query, Solved."
)


def _function(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": "Record the answer status.",
        "parameters": {"type": "object", "required": ["answer_status", "reason"], "properties": {
            "answer_status": {"type": "string", "enum": list(LABELS)},
            "reason": {"type": "string", "description": "why"}}}}}


class SoPRJudge:
    label = "SoPR (StableToolBench rules, LLM judge)"

    def __init__(self, base_url: str, model: str, *, api_key: str = "EMPTY", runs: int = 3, timeout: float = 60.0,
                 retries: int = 2, transport: Any = None, check: bool = True) -> None:
        import httpx

        if runs < 1:
            raise UsageError(f"judge runs must be >= 1 (StableToolBench uses 3), got {runs}")
        if check:  # at startup, not after an hour of episodes: the endpoint, and the model it serves
            from eval.agents.chat import check_model

            check_model(base_url, model, api_key=api_key, flag="--judge-model ", url_flag="--judge-url")
        self.model, self.runs, self.retries, self.base_url = model, runs, retries, base_url
        self.malformed = 0  # judgments counted as Unsure because the model's reply could not be read
        self._client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, transport=transport,
                                    headers={"Authorization": f"Bearer {api_key}"})
        self.tokens = 0

    def _ask(self, prompt: str, name: str) -> str:
        body = {"model": self.model, "temperature": 0.2, "max_tokens": 1000,
                "messages": [{"role": "user", "content": prompt}], "tools": [_function(name)],
                "tool_choice": {"type": "function", "function": {"name": name}}}
        import httpx

        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                response = self._client.post("/chat/completions", json=body)
                response.raise_for_status()
                data = response.json()
            except httpx.HTTPError as exc:  # the endpoint: retried, then the run stops
                last = exc
                time.sleep(0.2 * (attempt + 1))
                continue
            except ValueError as exc:
                # A body that is not JSON (a proxy's error page, a server that is not OpenAI-compatible) is
                # the endpoint's failure, not the judge model's: without this, json.JSONDecodeError escaped as
                # a traceback instead of the one-line JudgeUnavailableError naming --judge-url.
                last = httpx.DecodingError(f"the answer is not JSON ({exc})")
                time.sleep(0.2 * (attempt + 1))
                continue
            try:
                self.tokens += int((data.get("usage") or {}).get("total_tokens") or 0)
                call = data["choices"][0]["message"]["tool_calls"][0]["function"]
                status = json.loads(call["arguments"])["answer_status"]
                if status not in LABELS:
                    raise ValueError(f"judge answered {status!r}")
                return status
            except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:  # the model's reply
                last = exc
        if isinstance(last, httpx.HTTPError):
            raise JudgeUnavailableError(
                # Only the exception's first line: httpx's HTTPStatusError appends "\nFor more information check:
                # <url>", and the CLI's error must stay one line.
                f"the SoPR judge at {self.base_url} failed {self.retries + 1} times ({type(last).__name__}: "
                f"{(str(last).splitlines() or [''])[0]}); "
                "check --judge-url and --judge-model, then run the same command again to resume")
        self.malformed += 1  # documented: a reply the judge model got wrong every time counts as Unsure
        return "Unsure"

    def judge_once(self, query: str, answer: str | None, details: Sequence[dict[str, Any]]) -> str:
        # StableToolBench's rule: an empty answer or Finish(give_up_and_restart) is Unsolved without a model
        # call. Our simulated agents give up with an answer that starts "I give up" (their give_up_and_restart);
        # an answer that only mentions giving up ("I did not give up: ...") goes to the judge model.
        if (answer is None or not answer.strip() or answer.lstrip().lower().startswith("i give up")
                or "give_up_and_restart" in answer):
            return "Unsolved"
        status = self._ask(_CHECK.format(query=query, answer=answer), "check_answer_status")
        if status == "Unsure":
            payload = json.dumps({"final_answer": answer, "answer_details": list(details)})[:12000]
            status = self._ask(_PARSE.format(query=query, details=payload), "parse_answer_status")
        return status

    def judge(self, query: str, answer: str | None, details: Sequence[dict[str, Any]]) -> list[str]:
        """One label per run."""
        return [self.judge_once(query, answer, details) for _ in range(self.runs)]
