"""The one exception tree of ``intent``.

Catch :class:`IntentError` to catch everything the library raises on purpose::

    IntentError
    ├── UsageError (ValueError)           the user's input is wrong: a flag, a file, a config field
    │   ├── MarketError                   a market or a price is wrong
    │   │   ├── InvalidPriceError         negative, NaN or infinite price / budget
    │   │   └── UnpricedToolError (KeyError)  a tool with no price and no default
    │   ├── GuardConfigError (TypeError)  a BudgetGuard built with a bad argument
    │   └── LogFormatError                a log line is not a valid step record
    ├── LedgerError (RuntimeError)        a money operation the ledger cannot do
    │   └── BudgetExceededError           a reservation that does not fit
    │       └── ModelCallRefused          a model execution the budget does not cover (raised in its invoke)
    │           └── MeteredModelRefused (langchain ModelError)  one of guard.metered_model's, not retried
    ├── StoreError (RuntimeError)         a shared-budget store cannot do an operation (intent.stores)
    │   ├── StoreArgumentError (UsageError)  a wrong store URL, period or key scope
    │   ├── StoreUnavailableError         it could not be reached past its retries (a commit is kept and resent)
    │   └── KeptCommitRefusedError        a kept commit it refused when resent (dropped from the outbox, raised once)
    ├── InvalidDecisionError (TypeError)  an oracle returned something that is not a Decision
    ├── InvalidBillError (ValueError, TypeError)  a tool reported a bill that is not a number >= 0
    ├── OracleUnavailableError (RuntimeError)     the model behind an oracle could not answer
    │   ├── OracleTimeoutError (TimeoutError)           it did not answer in time
    │   ├── ModelUnreachableError (ConnectionError)     its server is down or overloaded
    │   ├── MalformedModelOutputError (ValueError)      it answered something unreadable
    │   └── ContextOverflowError (ValueError)           the prompt is longer than its context
    └── ModelRequestError (ValueError)    the model server refused the request itself (HTTP 4xx)

One warning: :class:`UnpricedToolWarning` (a ``UserWarning``), once per guard and tool, when the
model was offered a tool the market does not price (a middleware's own tool, such as
TodoListMiddleware's ``write_todos``): the guard refuses its calls, so price it
(``PricedTool(name, 0.0)`` for a free one).

A tool's own exception is never wrapped: the guard charges the run and re-raises it
unchanged (``tool_errors="raise"``), so retries and ``handle_tool_errors`` see what they
would see without the guard.

**Oracle failures.** Only an :class:`OracleUnavailableError` is *recoverable*: the guard (and
the planning oracles) then apply the documented fallback (``on_oracle_error`` /
``on_model_error``: accept a call only if it fits, or reject it) and log
``reason="oracle_error"``. :func:`as_oracle_unavailable` decides what counts as one:

* an :class:`OracleUnavailableError` (what the shipped backends raise);
* the standard library's ``TimeoutError`` and ``ConnectionError``;
* the timeout and connection errors of ``httpx`` and ``openai`` (and the ``openai`` client's
  5xx / 429 errors: the server is up but cannot answer now), the clients LangChain chat models
  and the OpenAI-compatible world model use;
* :class:`intent.model_protocols.ModelError` (also ``worldmodel.ModelError``), the world-model /
  predictor protocol's documented failure (server down, timeout, malformed reply);
* a prompt longer than the model's context (an HTTP 400 that says so, from any OpenAI-compatible
  server): :class:`ContextOverflowError`. A planning oracle's rollout ends there; elsewhere the
  fallback applies.

Everything else raised inside an oracle (a ``KeyError``, ``TypeError``, ``AttributeError`` in
its code, a :class:`ModelRequestError` from a misconfigured model name or URL) is a bug or a
configuration error: it propagates out of the guard unchanged, so the run fails loudly instead
of being silently decided by the fallback.

**User input and bugs.** A :class:`UsageError` says the user's input is wrong (a CLI flag, a file or
log the user pointed to, a config field of a public class, an argument of the public API); its
message names the input and says the fix, and ``intent``'s command line prints it as one line
(``intent bench: error: ...``, exit 2), as it does a ``FileNotFoundError``. A plain ``ValueError``
(or any other exception that is not an :class:`IntentError`) is a bug: the command line lets it
propagate with its traceback. The
harness's own input errors subclass UsageError (``eval``'s ``EndpointError``, ``StbDataError``,
``ResultsFormatError``, ``PromptDoesNotFitError``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "ContextOverflowError",
    "GuardConfigError",
    "IntentError",
    "InvalidBillError",
    "LogFormatError",
    "MalformedModelOutputError",
    "ModelRequestError",
    "ModelUnreachableError",
    "OracleTimeoutError",
    "OracleUnavailableError",
    "UnpricedToolWarning",
    "UsageError",
    "as_oracle_unavailable",
    "is_context_overflow",
    "model_call",
    "says_context_overflow",
]


class IntentError(Exception):
    """Base class of every error ``intent`` raises on purpose."""


class UsageError(IntentError, ValueError):
    """The user's input is wrong: a flag, a file, a config field; the message names it and says the fix.

    A ``ValueError`` too, so ``except ValueError`` keeps catching it. The command line prints it as one
    line (exit 2); a plain ``ValueError`` is a bug and keeps its traceback."""


class UnpricedToolWarning(UserWarning):
    """The model was offered a tool the market does not price; the guard refuses its calls."""


class GuardConfigError(UsageError, TypeError):
    """A :class:`~intent.BudgetGuard` argument is invalid; the message names it and the fix."""


class InvalidBillError(IntentError, ValueError, TypeError):
    """A tool reported what its provider billed (``intent_billed``) as something other than a
    finite number >= 0. A bug in the tool, so never turned into a tool error message: the run is
    charged at its quote and the error propagates."""


class LogFormatError(UsageError):
    """A log file line is not a valid :class:`~intent.logs.StepRecord`."""


class OracleUnavailableError(IntentError, RuntimeError):
    """The model behind an oracle (agent policy, world model, predictor) could not answer.

    The only recoverable oracle failure: the guard and the planning oracles fall back as
    documented (``on_oracle_error`` / ``on_model_error``) instead of failing the run.
    """


class OracleTimeoutError(OracleUnavailableError, TimeoutError):
    """A model call behind an oracle timed out (after the backend's own retries)."""


class ModelUnreachableError(OracleUnavailableError, ConnectionError):
    """The model server could not be reached, dropped the connection, or answered 5xx / 429."""


class MalformedModelOutputError(OracleUnavailableError, ValueError):
    """A model answered, but not in the documented shape (no content, a probability outside [0, 1]...)."""


class ContextOverflowError(OracleUnavailableError, ValueError):
    """The prompt does not fit the model's context window (an HTTP 400 whose message says so).

    Recoverable: the request was well formed, only too long. A rollout ends there (the agent
    could not have gone further either); any other oracle call falls back as documented."""


class ModelRequestError(IntentError, ValueError):
    """The model server refused the request itself (HTTP 4xx other than 429): a wrong model name,
    URL or key. Never recoverable: retrying or falling back would hide the misconfiguration."""


# What servers say when a prompt is longer than the context: vLLM ("This model's maximum context
# length is 8192 tokens. However, your prompt contains at least 8193 input tokens"), OpenAI
# (code "context_length_exceeded"), llama.cpp ("the request exceeds the available context size").
_CONTEXT_OVERFLOW_MARKERS = ("maximum context length", "context_length_exceeded", "exceeds the available context",
                             "context window")


def says_context_overflow(text: str) -> bool:
    """Whether a server's HTTP 400 error text says the prompt is longer than the model's context."""
    text = text.lower()
    return any(marker in text for marker in _CONTEXT_OVERFLOW_MARKERS)


def is_context_overflow(exc: BaseException) -> bool:
    """A :class:`ContextOverflowError`, or an HTTP 400 from an OpenAI-compatible client whose
    message says the prompt is too long (vLLM, OpenAI, llama.cpp texts)."""
    return isinstance(exc, ContextOverflowError) or (
        getattr(exc, "status_code", None) == 400 and says_context_overflow(f"{exc} {getattr(exc, 'code', '') or ''}"))


# Optional backends' recoverable errors, by module: (class name, typed error). Looked up in
# sys.modules only, never imported: an exception of a module nobody imported cannot have been
# raised, and checking must not pull httpx or openai into ``import intent``.
_BACKEND_ERRORS: dict[str, tuple[tuple[str, type[OracleUnavailableError]], ...]] = {
    "httpx": (
        ("TimeoutException", OracleTimeoutError),  # connect / read / write / pool timeouts
        ("NetworkError", ModelUnreachableError),  # connect, read, write, close errors
        ("RemoteProtocolError", ModelUnreachableError),  # the server closed the connection mid-answer
    ),
    "openai": (
        ("APITimeoutError", OracleTimeoutError),  # before APIConnectionError: it subclasses it
        ("APIConnectionError", ModelUnreachableError),
        ("InternalServerError", ModelUnreachableError),  # 5xx
        ("RateLimitError", ModelUnreachableError),  # 429
    ),
    # The world-model / predictor protocol's failure (server down, timeout, malformed reply).
    "intent.model_protocols": (("ModelError", OracleUnavailableError),),
}


def as_oracle_unavailable(exc: BaseException, what: str = "the oracle's model") -> OracleUnavailableError | None:
    """``exc`` as the recoverable error it is, or ``None`` if it is not recoverable (a bug).

    An :class:`OracleUnavailableError` is returned as is; a recoverable error of the standard
    library or of a backend is returned wrapped in the matching subclass (``__cause__`` is
    ``exc``); anything else gives ``None``: the caller must re-raise it.
    """
    if isinstance(exc, OracleUnavailableError):
        return exc
    if isinstance(exc, ModelRequestError):
        return None
    kind: type[OracleUnavailableError] | None = None
    if is_context_overflow(exc):
        kind = ContextOverflowError
    elif isinstance(exc, TimeoutError):
        kind = OracleTimeoutError
    elif isinstance(exc, ConnectionError):
        kind = ModelUnreachableError
    else:
        for module_name, classes in _BACKEND_ERRORS.items():
            module = sys.modules.get(module_name)
            if module is None:
                continue
            for class_name, typed in classes:
                cls = getattr(module, class_name, None)
                if isinstance(cls, type) and isinstance(exc, cls):
                    kind = typed
                    break
            if kind is not None:
                break
    if kind is None:
        return None
    typed_exc = kind(f"{what} failed: {type(exc).__name__}: {exc}")
    typed_exc.__cause__ = exc
    return typed_exc


@contextmanager
def model_call(what: str) -> Iterator[None]:
    """Around a model call inside an oracle: recoverable failures leave as typed errors.

    A timeout, an unreachable server or a malformed answer is re-raised as the matching
    :class:`OracleUnavailableError` subclass (naming ``what``, chained to the original); any
    other exception (a bug) leaves unchanged.
    """
    try:
        yield
    except Exception as exc:
        typed = as_oracle_unavailable(exc, what)
        if typed is None or typed is exc:
            raise
        raise typed from exc
