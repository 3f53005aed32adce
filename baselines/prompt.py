"""Prompt: prices in the prompt, a budget status line after every tool result, no gate.

For the benchmark it runs with ``enforce=False`` (a soft baseline). With the guard's hard
gate on (``enforce=True``) it is the production "tracker": the agent sees prices and its
budget, and the guard still refuses what does not fit.
"""

from __future__ import annotations

from intent import feedback as fb
from intent.market import Market
from intent.oracle import Decision, DecisionContext, Oracle, Outcome


class PromptOracle(Oracle):
    name = "prompt"
    enforce = False

    def decide(self, ctx: DecisionContext) -> Decision:
        return Decision.accepted()

    def prompt_notes(self, market: Market, episode_id: str, spent: float, remaining: float, budget: float) -> str:
        return fb.market_notes(market, spent, remaining, budget)

    def result_note(self, outcome: Outcome) -> str:
        return fb.budget_status(outcome.spent, max(0.0, outcome.budget - outcome.spent), outcome.budget)
