"""Cost-augmented StableToolBench: data loading, faithful naming and schemas, and SIMULATED parts
(prices, retrieval from the API pool, tool responses, proxy judge). See README.md here.

The data is read from a path outside the repository: ``root=`` / ``--stb-path``, else
``$INTENT_STB_PATH``, else ``<repo>/../shared/stabletoolbench``.
"""

from __future__ import annotations

from .env_base import (
    ERROR_STATUS_CODES,
    MAX_OBSERVATION_LENGTH,
    BaseToolEnvironment,
    ToolEnvironment,
    ToolResult,
    finish_step,
    parse_tool_input,
    truncate_observation,
)
from .environment import SchemaSimulator, missing_argument_error, unexpected_argument_error
from .loader import (
    ENV_VAR,
    GROUPS,
    Param,
    StbApi,
    StbDataError,
    StbQuery,
    api_pool,
    default_root,
    load_queries,
    resolve_root,
)
from .naming import change_name, function_name, standardize, standardize_category
from .payload import PayloadFiller, canonical_arguments, recover_truncated_json
from .prices import PriceFile, assign_prices, price_meta, read_prices, write_prices
from .proxy_judge import PROXY_LABEL, answer_given, proxy_pass, sopr_aggregate
from .remote_env import MIRROR_SYSTEM_PROMPT, OpenAICompatibleSimulator, ServerEnvironment, parse_simulator_output
from .retrieval import (
    DEFAULT_K,
    Embedder,
    MiniLMEmbedder,
    RetrievalResult,
    TfidfEmbedder,
    api_document,
    retrieve,
)
from .schemas import finish_tool_schema, openai_tool_schema

__all__ = [
    "DEFAULT_K",
    "ENV_VAR",
    "ERROR_STATUS_CODES",
    "GROUPS",
    "MAX_OBSERVATION_LENGTH",
    "MIRROR_SYSTEM_PROMPT",
    "PROXY_LABEL",
    "BaseToolEnvironment",
    "Embedder",
    "MiniLMEmbedder",
    "OpenAICompatibleSimulator",
    "Param",
    "PayloadFiller",
    "PriceFile",
    "RetrievalResult",
    "SchemaSimulator",
    "ServerEnvironment",
    "StbApi",
    "StbDataError",
    "StbQuery",
    "TfidfEmbedder",
    "ToolEnvironment",
    "ToolResult",
    "answer_given",
    "api_document",
    "api_pool",
    "assign_prices",
    "canonical_arguments",
    "change_name",
    "default_root",
    "finish_step",
    "finish_tool_schema",
    "function_name",
    "load_queries",
    "missing_argument_error",
    "openai_tool_schema",
    "parse_simulator_output",
    "parse_tool_input",
    "price_meta",
    "proxy_pass",
    "read_prices",
    "recover_truncated_json",
    "resolve_root",
    "retrieve",
    "sopr_aggregate",
    "standardize",
    "standardize_category",
    "truncate_observation",
    "unexpected_argument_error",
    "write_prices",
]
