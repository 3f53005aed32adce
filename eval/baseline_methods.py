"""The baselines as benchmark methods: raw, prompt, tracker, bats, dfsdt, btp.

The baselines themselves (``baselines/``) know nothing of the benchmark; what they need from
it (the simulated agent's reading of a result, the system prompt) is passed in here.
"""

from __future__ import annotations

from typing import Any

from eval.method_spec import SYSTEM_PROMPT, MethodContext, MethodSpec
from intent.oracle import Oracle

__all__ = ["METHODS"]


def _raw(ctx: MethodContext) -> Oracle:
    from baselines.raw import RawOracle

    return RawOracle()


def _prompt(ctx: MethodContext) -> Oracle:
    from baselines.prompt import PromptOracle

    return PromptOracle()


def _bats(ctx: MethodContext) -> Oracle:
    from baselines.bats import BATSOracle, LLMVerifier, SimulatedVerifier
    from eval.agents.simulated import looks_successful

    verify = ctx.options.get("bats_verify", True)
    verifier: Any = None
    if verify:
        view = ctx.env.view
        verifier = (SimulatedVerifier(view.needs, view.covers, view.reading, looks=looks_successful)
                    if ctx.simulated_agent
                    else LLMVerifier(ctx.model))
    return BATSOracle(verifier=verifier, planning=True, max_verifications=int(ctx.options.get("bats_k", 5)))


def _dfsdt_episode(env: Any, model: Any, guard: Any, episode_id: str, *, summarize: bool = False
                   ) -> tuple[list[Any], str | None, dict[str, Any]]:
    from baselines.dfsdt import DFSDTRunner

    from eval.markets import follow_market_events

    # The market's events reach the guard before each expansion, as they do before each of an agent's model steps.
    events = (None if env.market_now is None else lambda: follow_market_events(guard, episode_id, env.market_now))
    runner = DFSDTRunner(guard, env.tools, width=10, max_depth=12, max_llm_calls=60, system_prompt=SYSTEM_PROMPT,
                         before_model=events, summarize=summarize)
    res = runner.run(model, env.query, episode_id=episode_id)
    return res.messages, res.answer, {
        "ledger_channel": res.channel, "agent_tokens": res.tokens, "llm_calls": res.llm_calls,
        "nodes": res.nodes, "pruned": res.pruned, "backtracks": res.backtracks,
        "proposed_calls": res.proposed_calls, "answered_calls": res.answered_calls, "summarized": res.summarized,
    }


def _btp_episode(env: Any, model: Any, guard: Any, episode_id: str) -> tuple[list[Any], str | None, dict[str, Any]]:
    # BTP's code ends its DFS with summarize(): the answer written from every result the search gathered.
    return _dfsdt_episode(env, model, guard, episode_id, summarize=True)


def _btp(ctx: MethodContext) -> Oracle:
    from baselines.btp import BTPOracle, ExperienceStore
    from eval.agents.simulated import looks_successful

    res = ctx.resources
    store = res.get_or_build("btp_store", ExperienceStore.from_records, res.fold_for(ctx.env.task_id))
    view = ctx.env.view

    def useful(outcome: Any) -> bool:  # the usefulness judgment: the agent's own reading of the result
        needs = [n for n in view.needs if n.id in view.covers.get(outcome.proposal.tool, ())]
        return any(looks_successful(n, outcome.observation, view.reading) for n in needs)

    return BTPOracle(store, usefulness=useful if ctx.simulated_agent else None)


METHODS: tuple[MethodSpec, ...] = (
    MethodSpec("raw", False, _raw, "no cost information, no gate (soft)"),
    MethodSpec("prompt", False, _prompt, "prices and budget status in the prompt, no gate (soft)"),
    MethodSpec("tracker", True, _prompt, "Prompt with the guard's hard gate on (production tracker)"),
    MethodSpec("bats", True, _bats, "BATS: budget tracker, tiered guideline, self-verification (K=5), hard gate"),
    MethodSpec("dfsdt", True, _prompt, "DFSDT (width 10) with budget pruning: one shared ledger, prices shown, hard gate",
               episode=_dfsdt_episode),
    # On DFSDT, as INTENT's Appendix B.2 implements it and BTP's own code runs (StableToolBench's DFS).
    MethodSpec("btp", True, _btp, "BTP on DFSDT: knapsack call quotas from experience, forbidden tools, blacklist, "
               "summarized answer", episode=_btp_episode, needs_oracle_logs=True),
)
