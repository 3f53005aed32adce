"""The paper's planning oracles: MCO (Algorithm 2) and INTENT (Algorithm 3)."""

from intent.oracles.caches import EpisodeMemory, args_match
from intent.oracles.intent import IntentOracle
from intent.oracles.mco import MCOOracle

__all__ = ["EpisodeMemory", "IntentOracle", "MCOOracle", "args_match"]
