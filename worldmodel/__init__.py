"""World models, conditional generators and intention predictors (inference side).

Protocols live in :mod:`worldmodel.protocols`; prompts and serialisations shared with training
in :mod:`worldmodel.formats`. Backends: replay from logs,
OpenAI-compatible HTTP (vLLM in production), in-process transformers, and the ablation
predictors. Heavy dependencies (torch, transformers) are imported only by the backends that
need them.
"""

from worldmodel.protocols import (
    IntentionPredictor,
    ModelError,
    WorldModel,
    predict_many,
    simulate_counted,
)

__all__ = ["IntentionPredictor", "ModelError", "WorldModel", "predict_many", "simulate_counted"]
