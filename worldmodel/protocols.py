"""The two model interfaces the oracles use, and helpers that tolerate minimal implementations.

They are defined in :mod:`intent.model_protocols` (the oracles in ``intent`` need them, and ``intent`` imports
nothing above it); this module re-exports them under their old names, one object each.
"""

from __future__ import annotations

from intent.model_protocols import (
    AtTemperature,
    IntentionPredictor,
    ModelError,
    PredictorInput,
    WorldModel,
    accepts_temperature,
    predict_many,
    simulate_counted,
)

__all__ = ["AtTemperature", "IntentionPredictor", "ModelError", "PredictorInput", "WorldModel", "accepts_temperature",
           "predict_many", "simulate_counted"]
