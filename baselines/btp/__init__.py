"""BTP (Zheng et al. 2024): budget-constrained tool learning with planning, reimplemented.

:func:`plan_quotas` / :func:`plan_quotas_detailed` (the bounded knapsack, exact, with
traceback), :class:`ExperienceStore` (values and caps from past usages, e.g. ``intent.logs``
JSONL), :class:`BTPOracle` (quotas, forbidden tools, blacklist under the guard).
"""

from baselines.btp.experience import (
    Embedder,
    Estimates,
    ExperienceStore,
    MiniLMEmbedder,
    TfidfEmbedder,
    Usage,
)
from baselines.btp.knapsack import QuotaPlan, plan_quotas, plan_quotas_detailed
from baselines.btp.oracle import BTPOracle

__all__ = ["BTPOracle", "Embedder", "Estimates", "ExperienceStore", "MiniLMEmbedder", "QuotaPlan", "TfidfEmbedder",
           "Usage", "plan_quotas", "plan_quotas_detailed"]
