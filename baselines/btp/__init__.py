"""BTP (Zheng et al. 2024): budget-constrained tool learning with planning.

:func:`plan_quotas` (bounded knapsack), :class:`ExperienceStore` (values and caps from past
usages, built from ``intent.logs``), :class:`BTPOracle` (quotas, forbidden tools, blacklist).
"""

from baselines.btp.experience import Estimates, ExperienceStore, TfidfEmbedder, Usage
from baselines.btp.knapsack import QuotaPlan, plan_quotas, plan_quotas_detailed
from baselines.btp.oracle import BTPOracle

__all__ = ["BTPOracle", "Estimates", "ExperienceStore", "QuotaPlan", "TfidfEmbedder", "Usage", "plan_quotas",
           "plan_quotas_detailed"]
