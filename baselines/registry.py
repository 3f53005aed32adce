"""Registers the baselines with the benchmark by name: bats, dfsdt (and btp when present)."""

from __future__ import annotations

from typing import Any

from eval.methods import MethodContext, MethodSpec, register
from intent.oracle import Oracle


def _bats(ctx: MethodContext) -> Oracle:
    from baselines.bats import BATSOracle, LLMVerifier, SimulatedVerifier

    verify = ctx.options.get("bats_verify", True)
    verifier: Any = None
    if verify:
        verifier = (SimulatedVerifier(ctx.env.view.needs, ctx.env.view.covers, ctx.env.view.reading)
                    if ctx.simulated_agent
                    else LLMVerifier(ctx.model))
    return BATSOracle(verifier=verifier, planning=True, max_verifications=int(ctx.options.get("bats_k", 5)))


def _dfsdt_oracle(ctx: MethodContext) -> Oracle:
    from baselines.prompt import PromptOracle

    return PromptOracle()


def _dfsdt_episode(env: Any, model: Any, guard: Any, episode_id: str) -> tuple[list[Any], str | None, dict[str, Any]]:
    from baselines.dfsdt import DFSDTRunner
    from eval.runner import SYSTEM_PROMPT

    runner = DFSDTRunner(guard, env.tools, width=10, max_depth=12, max_llm_calls=60, system_prompt=SYSTEM_PROMPT)
    res = runner.run(model, env.query, episode_id=episode_id)
    return res.messages, res.answer, {
        "ledger_channel": res.channel, "agent_tokens": res.tokens, "llm_calls": res.llm_calls,
        "nodes": res.nodes, "pruned": res.pruned, "backtracks": res.backtracks,
    }


register(MethodSpec("bats", True, _bats, "BATS: budget tracker, tiered guideline, self-verification (K=5), hard gate"))
register(MethodSpec("dfsdt", True, _dfsdt_oracle,
                    "DFSDT (width 10) with budget pruning: one shared ledger, prices shown, hard gate",
                    episode=_dfsdt_episode))

try:  # BTP needs its experience store; it registers itself when its module is present
    import baselines.btp.method  # noqa: F401
except ModuleNotFoundError as exc:
    if exc.name not in ("baselines.btp", "baselines.btp.method"):
        raise
