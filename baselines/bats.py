"""BATS (Liu et al. 2025), adapted to one global money budget as the INTENT paper did.

* **Budget tracker**: after every tool result the agent sees ``<budget>used/remaining</budget>``.
* **Tiered guideline** in the system prompt, by the share of the budget left:
  HIGH (>= 70%), MEDIUM (30-70%), LOW (10-30%), CRITICAL (< 10%); each tier says how many
  calls to make and when to answer.
* **Planning checklist** (optional) in the system prompt.
* **Self-verification** (optional): after a tool result a verifier answers SUCCESS (answer
  now), CONTINUE or PIVOT (change approach), at most ``max_verifications`` (K = 5) times per
  iteration (model turn). Its LLM cost is counted in :meth:`episode_usage` (the token metric).
* The guard's hard gate stays on: BATS runs with ``enforce=True``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from intent.errors import UsageError
from intent.feedback import price_list
from intent.market import Market
from intent.oracle import Decision, DecisionContext, Oracle, Outcome

__all__ = ["BATSOracle", "LLMVerifier", "Tier", "Verifier", "tier_for", "TIER_GUIDELINES"]

Tier = Literal["HIGH", "MEDIUM", "LOW", "CRITICAL"]
Verdict = Literal["SUCCESS", "CONTINUE", "PIVOT"]

TIER_GUIDELINES: dict[str, str] = {
    "HIGH": "Budget tier HIGH (at least 70% left): you may explore; make the calls the task needs, "
            "preferring reliable tools for the hard parts.",
    "MEDIUM": "Budget tier MEDIUM (30-70% left): be selective; only call tools that fill a missing piece, "
              "and prefer the cheaper of equivalent tools.",
    "LOW": "Budget tier LOW (10-30% left): make at most one or two essential calls with the cheapest adequate "
           "tool, then answer.",
    "CRITICAL": "Budget tier CRITICAL (under 10% left): do not call more tools; answer now with what you have.",
}

PLANNING_CHECKLIST = (
    "Before calling tools, plan: (1) list the pieces of information the question needs; (2) for each, pick "
    "the tool with the best value for its price; (3) keep a reserve for one retry; (4) answer as soon as "
    "every piece is in."
)


def tier_for(remaining: float, budget: float) -> Tier:
    """The tier for the share of the budget left (boundaries: 0.7, 0.3, 0.1; lower bounds inclusive)."""
    # A share that is a boundary up to float noise (2.7 spent of 3 leaves 0.29999999999999982) is on it.
    share = 1.0 if budget <= 0 else remaining / budget + 1e-9
    if share >= 0.7:
        return "HIGH"
    if share >= 0.3:
        return "MEDIUM"
    if share >= 0.1:
        return "LOW"
    return "CRITICAL"


def tracker_block(spent: float, remaining: float) -> str:
    return f"<budget>{spent:g}/{remaining:g}</budget>"


@dataclass(frozen=True)
class Verification:
    verdict: Verdict
    reason: str = ""
    tokens: int = 0


class Verifier(Protocol):
    def verify(self, query: str, tool: str, observation: str, episode_id: str) -> Verification: ...


_VERIFY_PROMPT = (
    "You check an agent's progress on a task.\nTask: {query}\nLast tool: {tool}\nLast result: {observation}\n"
    "Reply with exactly one word first: SUCCESS if the task can be answered now, CONTINUE if the current "
    "approach is working, PIVOT if it is not and a different tool or approach is needed. Then one sentence why."
)


class LLMVerifier:
    """Self-verification through any LangChain chat model (the agent's own, as in BATS)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def verify(self, query: str, tool: str, observation: str, episode_id: str) -> Verification:
        reply = self.model.invoke(_VERIFY_PROMPT.format(query=query, tool=tool, observation=observation[:1500]))
        text = str(reply.content).strip()
        word = text.split()[0].strip(".:,").upper() if text else "CONTINUE"
        verdict: Verdict = word if word in ("SUCCESS", "CONTINUE", "PIVOT") else "CONTINUE"  # type: ignore[assignment]
        tokens = int((getattr(reply, "usage_metadata", None) or {}).get("total_tokens", 0))
        return Verification(verdict, text, tokens)


ENDED_KEPT = 4096  # ended episodes whose usage BATSOracle keeps for episode_usage


class BATSOracle(Oracle):
    name = "bats"
    enforce = True

    def __init__(self, *, verifier: Verifier | None = None, planning: bool = True,
                 max_verifications: int = 5, show_prices: bool = True) -> None:
        if max_verifications < 0:
            raise UsageError(f"max_verifications must be >= 0 (BATS uses K=5), got {max_verifications}")
        self.verifier = verifier
        self.planning = planning
        self.max_verifications = max_verifications
        self.show_prices = show_prices
        self._lock = threading.Lock()
        self._episodes: dict[str, dict[str, Any]] = {}
        # The usage of episodes whose run ended (episode_usage is read after the run), the latest kept.
        self._ended: OrderedDict[str, dict[str, float]] = OrderedDict()

    def _ep(self, episode_id: str) -> dict[str, Any]:
        with self._lock:
            return self._episodes.setdefault(
                episode_id, {"query": "", "step": -1, "verifications": 0, "tokens": 0, "llm_calls": 0})

    def decide(self, ctx: DecisionContext) -> Decision:
        ep = self._ep(ctx.episode_id)
        ep["query"] = ctx.query
        if ctx.step != ep["step"]:  # a new iteration: the verification budget K resets
            ep["step"], ep["verifications"] = ctx.step, 0
        return Decision.accepted()

    def prompt_notes(self, market: Market, episode_id: str, spent: float, remaining: float, budget: float) -> str:
        parts = [f"You have a hard budget of {budget:g} for tool calls; every call is charged its price."]
        if self.show_prices:
            parts.append(price_list(market))
        parts.append(f"Budget tracker: {tracker_block(spent, remaining)}")
        parts.append(TIER_GUIDELINES[tier_for(remaining, budget)])
        if self.planning:
            parts.append(PLANNING_CHECKLIST)
        return "\n".join(parts)

    def result_note(self, outcome: Outcome) -> str:
        note = tracker_block(outcome.spent, outcome.remaining)
        if self.verifier is None:
            return note
        ep = self._ep(outcome.episode_id)
        with self._lock:
            allowed = ep["verifications"] < self.max_verifications
            if allowed:
                ep["verifications"] += 1
        if not allowed:
            return note
        v = self.verifier.verify(ep["query"], outcome.proposal.tool, outcome.observation, outcome.episode_id)
        with self._lock:
            ep["tokens"] += v.tokens
            ep["llm_calls"] += 1
        return f"{note}\n[Verify] {v.verdict}: {v.reason}".rstrip(": ")

    def end(self, episode_id: str) -> None:
        """The run ended: its working state is dropped, its usage kept (among the latest ``ENDED_KEPT``)."""
        with self._lock:
            ep = self._episodes.pop(episode_id, None)
            if ep is None:
                return
            earlier = self._ended.pop(episode_id, {"tokens": 0.0, "llm_calls": 0.0})  # an earlier run of the thread
            self._ended[episode_id] = {"tokens": earlier["tokens"] + ep["tokens"],
                                       "llm_calls": earlier["llm_calls"] + ep["llm_calls"]}
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)

    def episode_usage(self, episode_id: str) -> Mapping[str, float]:
        with self._lock:
            ep, ended = self._episodes.get(episode_id), self._ended.get(episode_id, {"tokens": 0.0, "llm_calls": 0.0})
            live = (ep["tokens"], ep["llm_calls"]) if ep else (0, 0)
        return {"tokens": ended["tokens"] + float(live[0]), "llm_calls": ended["llm_calls"] + float(live[1])}


class SimulatedVerifier:
    """A rule-based stand-in for the LLM verifier, for the simulated agent (labelled simulated).

    SUCCESS when every need of the task looks satisfied, PIVOT when the last result looks like a
    failure of a tool that already failed before in this episode, else CONTINUE. Tokens are
    estimated as characters / 4 of the prompt it would have sent.
    """

    def __init__(self, needs: Sequence[Any], covers: Mapping[str, frozenset[str]], reading: str = "entity", *,
                 looks: Callable[[Any, str, str], bool]) -> None:
        # ``looks(need, observation, reading)``: the simulated agent's own reading of a result,
        # passed in by the benchmark (baselines do not import the benchmark).
        self._looks = looks
        self.reading = reading
        self.needs = list(needs)
        self.covers = covers
        self._lock = threading.Lock()
        self._state: dict[str, dict[str, Any]] = {}

    def verify(self, query: str, tool: str, observation: str, episode_id: str) -> Verification:
        with self._lock:
            st = self._state.setdefault(episode_id, {"satisfied": set(), "failed": {}})
            got = {n.id for n in self.needs if n.id in self.covers.get(tool, ()) and self._looks(n, observation, self.reading)}
            st["satisfied"] |= got
            if not got:
                st["failed"][tool] = st["failed"].get(tool, 0) + 1
            tokens = len(_VERIFY_PROMPT) // 4 + (len(query) + len(observation[:1500])) // 4 + 12
            if len(st["satisfied"]) == len(self.needs):
                return Verification("SUCCESS", "every piece of information is in", tokens)
            if not got and st["failed"][tool] >= 2:
                return Verification("PIVOT", f"{tool} keeps failing; switch to another tool", tokens)
            return Verification("CONTINUE", "", tokens)
