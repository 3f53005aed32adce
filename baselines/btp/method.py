"""Registers ``btp`` with the benchmark: experience from the oracle-training logs."""

from __future__ import annotations

from typing import Any

from eval.methods import MethodContext, MethodSpec, register
from intent.oracle import Oracle


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


register(MethodSpec("btp", True, _btp, "BTP: knapsack call quotas from experience, forbidden tools, blacklist"))
