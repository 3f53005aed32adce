"""BudgetGuard: an oracle + a market + a budget, as LangChain middleware or LangGraph nodes.

One guarded step:

1. before each model call (:meth:`BudgetGuard.prepare`), reservations that someone else
   answered (a call limit, a human's reject, another middleware's ToolMessage) are released,
   charges the state has not seen yet are written to it, and the oracle's ``start`` hook
   runs for a new episode, so a plan is in force before the model first sees the tools;
2. the *gate* (inside the middleware's ``wrap_model_call`` right after the model answers, or
   its ``after_model`` hook with ``gate_at="after_model"``, or :meth:`BudgetGuard.node`) goes
   through the calls of the new message **in order, as one batch**: prices from one market snapshot, the oracle's
   decision, then the guard's own check that the call fits what is left after the
   reservations made earlier in the batch. Accepted calls are reserved and the decision is
   written to graph state; rejected ones get a ToolMessage with the feedback, cost nothing;
3. the tool step (:meth:`BudgetGuard.wrap_tool_call`) hands a *metered* tool to the rest of
   the chain: each time the tool really runs (a retry included) it is re-priced, reserved
   (the first run uses the gate's reservation), run and committed with what the provider
   billed. A run that no longer fits is answered with a refusal and does not run;
4. the call's ToolMessage and every charge go back to state; a reservation nothing used is
   released; after the run (:meth:`BudgetGuard.finish`) nothing stays reserved and the
   episode's in-process state is dropped.

The pieces live in their own modules: :mod:`intent.episodes` (per-episode working state),
:mod:`intent.records` (log records), :mod:`intent.messages` (message helpers),
:mod:`intent.gate` (the batch gate), :mod:`intent.metering` (one metered call),
:mod:`intent.state` (the graph-state channel), :mod:`intent.lifecycle` (an episode's start, settling
and end: ``prepare`` / ``finish``), :mod:`intent.top_ups` (``top_up`` / ``atop_up`` / ``scope``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.messages import ToolMessage
from langgraph.errors import ParentCommand
from langgraph.types import Command

from intent import feedback as fb
from intent import lean_path, lifecycle, top_ups
from intent.episodes import Episode, EpisodeRegistry
from intent.budget import Budget
from intent.arguments import is_list_arg
from intent.errors import (
    GuardConfigError,
    InvalidBillError,
    OracleUnavailableError,
    UnpricedToolWarning,
    UsageError,
    as_oracle_unavailable,
)
from intent.ledger import BudgetLedger
from intent.logs import LogSink
from intent.market import Market, PricedTool, UnpricedToolError, check_amount
from intent.gate import gate_batch
from intent.messages import provider_run, tool_name
from intent.oracle import (
    ORACLE_ERROR,
    Decision,
    DecisionContext,
    InvalidDecisionError,
    Oracle,
)
from intent.records import Recorder
from intent.metering import ORACLE_BUG_MARK, is_oracle_bug, open_call
from intent.model_gate import ModelGate
from intent.model_meter import PromptTokens
from intent.nesting import FromParent, carves_from_store, current_parent
from intent.off_loop import off_loop
from intent.pricing import ModelPrice, ModelPrices
from intent.state import LEDGER_KEY, GuardState, channel_of
from intent.top_ups import thread_id_of

if TYPE_CHECKING:
    from langgraph.prebuilt.tool_node import ToolCallRequest

__all__ = ["LEDGER_KEY", "BudgetGuard", "GuardState", "OracleErrorPolicy", "ToolErrorPolicy"]

OracleErrorPolicy = Literal["accept_if_fits", "reject"]
ToolErrorPolicy = Literal["raise", "message"]



class BudgetGuard:
    """Gate every priced tool call of an agent through an oracle and a hard budget.

    ``BudgetGuard(oracle, market, budget, *, enforce=True, log_sink=None,
    on_oracle_error="accept_if_fits", tool_errors="raise", max_episodes=1024,
    merge_identical_calls=True, notes_at="end", feedback_chars=None)``

    * ``enforce=False`` is for the soft benchmark baselines only: calls that do not fit are
      still run, and the overspend is recorded in the ledger (``overspent``) and the logs.
    * ``on_oracle_error``: what to do when the oracle fails in a *recoverable* way: a timeout,
      an unreachable model server, a malformed model answer (an
      :class:`~intent.errors.OracleUnavailableError`, or what
      :func:`~intent.errors.as_oracle_unavailable` maps to one: ``TimeoutError``,
      ``ConnectionError``, httpx / openai timeouts and connection errors, ``intent.model_protocols.ModelError``).
      ``"accept_if_fits"`` accepts only a call that fits; ``"reject"`` rejects; the decision
      is logged with ``reason="oracle_error"``. Any other exception from the oracle (a bug in
      its code: ``KeyError``, ``TypeError``, ...) is not a fallback case: it propagates
      unchanged out of the gate (``invoke`` / ``ainvoke`` raise it), whatever
      ``tool_errors`` says, and the batch being gated is left undecided (nothing of it is
      reserved, charged or logged). An oracle that returns something other than a
      :class:`Decision` raises :class:`~intent.oracle.InvalidDecisionError`.
    * ``tool_errors``: a tool that raises is charged (money spent is spent), then
      ``"raise"`` (default) re-raises the exception unchanged, so ToolRetryMiddleware and
      ``handle_tool_errors`` behave as without the guard; ``"message"`` answers the call
      with an error ToolMessage saying what it cost instead. Only the tool's own error: an
      exception another middleware inside the guard raises propagates in both modes.
    * ``max_episodes``: episodes whose working state is kept in memory at once (an
      episode's state is dropped when it ends; graph state stays the truth).
    * ``merge_identical_calls``: identical calls (same tool, same arguments) in one model message
      run once and are charged once: the later copies are removed from the message (recorded in
      its ``additional_kwargs["intent_merged_calls"]`` as ``{dropped id: kept id}`` and logged
      with ``reason="duplicate_call"``), so the oracle judges the call once and the model sees
      one call with one result. Small models repeat a call 5-16 times in one reply. MCO's and
      INTENT's rollouts simulate a turn's identical calls the same way; an oracle with another
      ``merge_identical_calls`` is refused (:class:`~intent.errors.GuardConfigError`).
    * ``budget``: a float, an :class:`~intent.budget.Budget` (``total``, ``tools`` / ``llm``
      sub-caps, ``currency``), or :class:`~intent.nesting.FromParent` for a sub-agent.
    * ``model_prices`` (``{"model-name": ModelPrice(...)}`` or :class:`~intent.pricing.ModelPrices`):
      the agent's model calls are charged in the same ledger (:mod:`intent.model_meter`), with
      ``unpriced_model`` ("refuse" | "worst_case"), ``missing_usage`` ("worst_case" | "refuse"),
      ``prompt_tokens`` ("bytes" | "model" | a function) and ``max_output_tokens`` (bound into a
      request that has none). ``charge_models=False`` keeps the table for the oracle only.
    * ``on_over_budget="ask"``: a call that does not fit pauses the run with an interrupt and a
      human may top up, approve once or deny (:mod:`intent.human`).
    * ``charge_oracle`` / ``oracle_model`` / ``oracle_max_tokens``: the oracle's own tokens charged.
    * ``store`` / ``budget_key``: the episode also draws on a shared budget (:mod:`intent.stores`).
      ``outbox_journal``: a file (one per process) where a commit the store could not take is kept
      until it is sent, so that a crash in between does not lose it (:mod:`intent.stores.journal`).
    * ``feedback_chars``: a cap on the refusal notes the agent reads, for models with a small
      context (``None``, the default: no cap). In one turn the refusals' notes are given in full
      while their total fits; later ones get their first lines only, and in later model calls
      the refusals of earlier turns are shown in that short form (the request only: graph
      state keeps every note). A 0.5B model whose 14 calls of one turn were refused got 15,448
      characters of plans back, and the episode then overflowed its 8,192-token context.
    * ``gate_at``: where the middleware gates a message's calls. ``"model_call"``: inside
      ``wrap_model_call``, right after the model answers; the decisions and reservations come
      back with the response as one state update, and the gate sees the calls before any other
      middleware's ``after_model`` in every list order. ``"after_model"``: in an ``after_model``
      hook, one more graph step per turn (about 0.1 ms per tool call), but the model's message
      is checkpointed before the gate runs, so an interrupt in the gate or a crash of the oracle
      resumes by gating the same message again; inside the model call the resumed step asks the
      model again. ``"auto"`` (default): ``"after_model"`` with ``on_over_budget="ask"`` (a
      human's answer resumes the gate), else ``"model_call"``.
    * ``notes_at``: where the oracle's per-turn prompt notes go. ``"end"`` (default): a
      trailing system message after the conversation, so the stable prefix (system prompt,
      history) stays cacheable by the server's prefix cache; ``"system"``: appended to the
      system prompt (for providers that accept only a leading system message).
    """

    def __init__(
        self,
        oracle: Oracle | Any,
        market: Market,
        budget: float | Budget | FromParent,
        *,
        enforce: bool = True,
        log_sink: LogSink | None = None,
        on_oracle_error: OracleErrorPolicy = "accept_if_fits",
        tool_errors: ToolErrorPolicy = "raise",
        max_episodes: int = 1024,
        merge_identical_calls: bool = True,
        notes_at: Literal["end", "system"] = "end",
        feedback_chars: int | None = None,
        model_prices: ModelPrices | Mapping[str, ModelPrice] | None = None,
        unpriced_model: Literal["refuse", "worst_case"] = "refuse",
        missing_usage: Literal["worst_case", "refuse"] = "worst_case",
        prompt_tokens: PromptTokens = "bytes",
        max_output_tokens: int = 4096,
        on_over_budget: Literal["refuse", "ask"] = "refuse",
        charge_models: bool | None = None,
        charge_oracle: bool = False,
        oracle_model: str | None = None,
        oracle_max_tokens: int | None = None,
        store: Any = None,
        budget_key: str | None = None,
        outbox_journal: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        gate_at: Literal["auto", "model_call", "after_model"] = "auto",
    ) -> None:
        if isinstance(oracle, type):
            raise GuardConfigError(f"oracle is the class {oracle.__name__}, not an oracle; pass an instance: "
                                   f"{oracle.__name__}(...)")
        if not callable(getattr(oracle, "decide", None)):
            raise GuardConfigError(
                f"oracle must have a decide(ctx) -> Decision method, got {type(oracle).__name__}; "
                "subclass intent.Oracle or pass intent.AcceptAll()"
            )
        if not isinstance(market, Market):
            raise GuardConfigError(
                f"market must be an intent.Market, got {type(market).__name__}; build one with Market([...])")
        if on_oracle_error not in ("accept_if_fits", "reject"):
            raise GuardConfigError(f"on_oracle_error must be 'accept_if_fits' or 'reject', got {on_oracle_error!r}")
        if tool_errors not in ("raise", "message"):
            raise GuardConfigError(f"tool_errors must be 'raise' or 'message', got {tool_errors!r}")
        for flag, value in (("enforce", enforce), ("merge_identical_calls", merge_identical_calls),
                            ("charge_oracle", charge_oracle), ("charge_models", charge_models)):
            if not (isinstance(value, bool) or value is None and flag == "charge_models"):
                # A string such as "no" would read as True: refused rather than guessed.
                raise GuardConfigError(f"{flag} must be True or False, got {value!r}")
        if log_sink is not None and not callable(getattr(log_sink, "write", None)):
            raise GuardConfigError(
                f"log_sink must have a write(record) method, got {type(log_sink).__name__} {log_sink!r}; pass "
                "intent.logs.JsonlLogSink(path) for a file, or MemoryLogSink()")
        if not (model_prices is None or isinstance(model_prices, (ModelPrices, Mapping))):
            raise GuardConfigError(
                f"model_prices must map model names to prices, got {type(model_prices).__name__}; pass "
                "{'gpt-4o-mini': ModelPrice(input_per_mtok=0.15, output_per_mtok=0.6)} or ModelPrices.from_file(path)")
        if isinstance(max_episodes, bool) or not isinstance(max_episodes, int) or max_episodes < 1:
            raise GuardConfigError(f"max_episodes must be a positive int, got {max_episodes!r}")
        if notes_at not in ("end", "system"):
            raise GuardConfigError(f"notes_at must be 'end' or 'system', got {notes_at!r}")
        if unpriced_model not in ("refuse", "worst_case"):
            raise GuardConfigError(f"unpriced_model must be 'refuse' or 'worst_case', got {unpriced_model!r}")
        if missing_usage not in ("worst_case", "refuse"):
            raise GuardConfigError(f"missing_usage must be 'worst_case' or 'refuse', got {missing_usage!r}")
        if not (prompt_tokens in ("bytes", "model") or callable(prompt_tokens)):
            raise GuardConfigError(
                f"prompt_tokens must be 'bytes', 'model' or a function (messages, tools) -> int, got {prompt_tokens!r}")
        if isinstance(max_output_tokens, bool) or not isinstance(max_output_tokens, int) or max_output_tokens < 1:
            raise GuardConfigError(f"max_output_tokens must be a positive int, got {max_output_tokens!r}")
        if on_over_budget not in ("refuse", "ask"):
            raise GuardConfigError(f"on_over_budget must be 'refuse' or 'ask' (a human top-up), got {on_over_budget!r}")
        if gate_at not in ("auto", "model_call", "after_model"):
            raise GuardConfigError(f"gate_at must be 'auto', 'model_call' or 'after_model', got {gate_at!r}")
        if gate_at == "model_call" and on_over_budget == "ask":
            raise GuardConfigError(
                "on_over_budget='ask' needs gate_at='after_model' (or 'auto'): a human's answer resumes the gate, "
                "and inside the model call that would ask the model again")
        # A human's top-up is an interrupt in the gate: it must resume on a checkpointed message.
        self.gate_at: Literal["model_call", "after_model"] = (
            ("after_model" if on_over_budget == "ask" else "model_call") if gate_at == "auto" else gate_at)
        if charge_oracle and (oracle_model is None or oracle_model not in ModelPrices.of(model_prices)):
            raise GuardConfigError(
                "charge_oracle=True needs oracle_model='<name>' with a price in model_prices: the oracle's tokens "
                "(Decision.usage) are charged at that model's price")
        if (store is None) != (budget_key is None):
            raise GuardConfigError("store= and budget_key= go together: BudgetGuard(..., store=SqliteBudgetStore(path), "
                                   "budget_key='customer-42/2026-11-23')")
        if outbox_journal is not None and store is None:
            raise GuardConfigError("outbox_journal= keeps commits for a shared budget store; pass it with store= and "
                                   "budget_key=, or leave it out")
        if store is not None:
            for method in ("reserve", "commit", "release", "spent", "reserved", "budget", "left"):
                if not callable(getattr(store, method, None)):
                    got = f"got {type(store).__name__} {store!r:.60}, which has no {method}()"
                    raise GuardConfigError(
                        f"store must be an intent.stores.BudgetStore, {got}; use MemoryBudgetStore(), "
                        "SqliteBudgetStore(path) or PostgresBudgetStore(dsn), or open_store(url) for a URL "
                        "(from intent.stores import open_store)")
            store.budget(budget_key)  # the shared budget must exist: StoreError names the fix
        self.store, self.budget_key = store, budget_key
        # The agent's model calls are charged when a price table is given, unless the table is only
        # there for the oracle's tokens (charge_models=False).
        self.charge_models = (len(ModelPrices.of(model_prices)) > 0) if charge_models is None else bool(charge_models)
        if self.charge_models and not len(ModelPrices.of(model_prices)) and unpriced_model == "refuse":
            raise GuardConfigError("charge_models=True needs model_prices={'model-name': ModelPrice(...)}")
        if oracle_model is not None and (not isinstance(oracle_model, str) or not oracle_model.strip()):
            raise GuardConfigError(f"oracle_model must be a model name in model_prices (a non-empty str) or None, got "
                                   f"{oracle_model!r}")
        if not callable(clock):
            raise GuardConfigError(f"clock must be a function () -> float seconds, got {type(clock).__name__} "
                                   f"{clock!r}; leave it out (time.perf_counter)")
        if oracle_max_tokens is not None and (isinstance(oracle_max_tokens, bool) or not isinstance(
                oracle_max_tokens, int) or oracle_max_tokens < 1):
            raise GuardConfigError(f"oracle_max_tokens must be a positive int (tokens per decision), got "
                                   f"{oracle_max_tokens!r}")
        self.charge_oracle = bool(charge_oracle)
        self.oracle_model = oracle_model
        self.oracle_max_tokens = oracle_max_tokens
        self.merge_identical_calls = bool(merge_identical_calls)
        oracle_merges = getattr(oracle, "merge_identical_calls", None)
        if oracle_merges is not None and bool(oracle_merges) != self.merge_identical_calls:
            # The oracle's rollouts would price a message's identical calls otherwise than the guard
            # runs and charges them: plans too cheap (guard runs each) or too dear (guard merges).
            raise GuardConfigError(
                f"merge_identical_calls={self.merge_identical_calls} but the oracle "
                f"{type(oracle).__name__} has merge_identical_calls={bool(oracle_merges)}; build both with the "
                "same value")
        self.notes_at = notes_at
        self.feedback_chars = fb.check_feedback_chars(feedback_chars)
        self.oracle = oracle
        if isinstance(budget, FromParent):
            self.budget_spec: Budget | FromParent = budget
        elif isinstance(budget, Budget):
            self.budget_spec = budget
        else:
            self.budget_spec = Budget(check_amount(budget, "budget"))
        self.budget = self.budget_spec.total
        self.model_prices = ModelPrices.of(model_prices)
        self.unpriced_model = unpriced_model
        self.missing_usage = missing_usage
        self.prompt_tokens = prompt_tokens
        self.max_output_tokens = max_output_tokens
        self.on_over_budget = on_over_budget
        self.currency = _check_currencies(self.budget_spec, market, self.model_prices)
        if store is not None and callable(getattr(store, "currency", None)):
            in_store = store.currency(budget_key)
            if in_store and self.currency and in_store.upper() != self.currency.upper():
                raise GuardConfigError(
                    f"the shared budget {budget_key!r} is kept in {in_store} but this guard's money is in "
                    f"{self.currency}; a budget has one currency: price in {in_store}, or use a key created in "
                    f"{self.currency}")
        self.enforce = bool(enforce)
        self.log_sink = log_sink
        self.on_oracle_error = on_oracle_error
        self.tool_errors = tool_errors
        self._clock = clock
        self._market = market
        spec = self.budget_spec
        if isinstance(spec, FromParent):
            def new_ledger(episode_id: str) -> BudgetLedger:
                return spec.carve(episode_id, allow_overspend=not self.enforce, currency=self.currency)
        else:
            def new_ledger(episode_id: str) -> BudgetLedger:
                return BudgetLedger(spec, allow_overspend=not self.enforce)
        # The ledgers draw on the store through one outbox per guard: a commit the store cannot take for now is
        # kept (past the episode's end) and sent again before the guard's next operation on the store.
        self.store_outbox: Any = None
        if store is not None:
            from intent.stores import CommitOutbox  # (only a guard with a store loads the stores)

            self.store_outbox = CommitOutbox(store, journal=outbox_journal)

        def share(ledger: BudgetLedger, episode_id: str) -> None:
            if self.store_outbox is not None:
                ledger.share(self.store_outbox, self.budget_key, episode_id)

        self._carves_from_parent = isinstance(spec, FromParent)
        self.episodes = EpisodeRegistry(spec, allow_overspend=not self.enforce, max_episodes=max_episodes,
                                        new_ledger=new_ledger, on_new=share, carves=self._carves_from_parent)
        self._hooks: dict[str, bool] = {}  # which optional oracle hooks are really implemented
        self._warned_unpriced: set[str] = set()  # tools offered to the model without a price, warned once
        self.made_metered_models = False  # metered_model was called: model steps name their episode
        self._model_gate = ModelGate(self)
        self.records = Recorder(log_sink, str(getattr(oracle, "name", None) or type(oracle).__name__), self.enforce)

    def reaches_store(self) -> bool:
        """Whether this guard's steps here may wait on a shared budget store, so that its async hooks run them
        in a worker thread (intent.off_loop): its own store, or, for a sub-agent (``FromParent``) without one,
        the store the budget it carves from is in (its carve, the carve's close and a top-up growing it are
        reservations and commits there), up the chain of carves."""
        return self.store_outbox is not None or (self._carves_from_parent and carves_from_store(current_parent()))

    # ================================================================== market
    @property
    def market(self) -> Market:
        return self._market

    def update_market(self, update: Market | Callable[[Market], Market]) -> Market:
        """Swap the market for every episode; applies from the next decision or run on."""
        new = update(self._market) if callable(update) else update
        if not isinstance(new, Market):
            raise GuardConfigError(f"update_market needs a Market (or a function of the current Market returning one), "
                                   f"got {type(new).__name__} {new!r:.80}; e.g. guard.update_market(lambda m: "
                                   "m.with_price('tool', 2.0))")
        self._market = new
        return new

    def update_episode_market(self, episode_id: str, update: Market | Callable[[Market], Market], *,
                              create: bool = False) -> Market:
        """Swap the market of one episode only (e.g. CostBench-style mid-episode events).

        The episode must be live here (a run of the thread going on, or a market set for it before); an id
        that is not is refused, since it is most likely a typo that would otherwise set a market no run reads.
        ``create=True`` makes the episode, to give a thread its own market before its run starts here."""
        if not isinstance(episode_id, str):
            raise GuardConfigError(f"update_episode_market: episode_id must be the run's thread_id (a str), got "
                                   f"{type(episode_id).__name__} {episode_id!r}")
        if not (callable(update) or isinstance(update, Market)):
            raise GuardConfigError(f"update_episode_market needs a Market (or a function of the episode's Market "
                                   f"returning one), got {type(update).__name__} {update!r:.80}")
        episode = self.episodes.get(episode_id) if create else self.episodes.peek(episode_id)
        if episode is None:
            live = self.episodes.ids()
            shown = ", ".join(map(repr, live[-5:])) + (f" (and {len(live) - 5} more)" if len(live) > 5 else "")
            raise UsageError(
                f"update_episode_market: no live episode {episode_id!r} (the episode id is the run's thread_id; "
                f"live here: {shown or 'none'}; guard.episodes.ids() lists them). To give a thread whose run has "
                "not started here a market of its own, pass create=True")
        with episode.lock:
            current = episode.market or self._market
            new = update(current) if callable(update) else update
            if not isinstance(new, Market):
                raise GuardConfigError(f"update_episode_market: the function returned {type(new).__name__} "
                                       f"{new!r:.80}, not a Market; return the new Market (e.g. m.with_price(...))")
            episode.market = new
            return new

    def learn_price(self, episode_id: str, tool: str, price: float, currency: str | None = None) -> Market:
        """A tool stated its price in an answer (x402 "payment required"): it applies to the
        episode's next calls of that tool. A price in another currency is an error naming the tool."""
        if currency and self.currency and currency.upper() != self.currency.upper():
            raise GuardConfigError(f"tool {tool!r} asks for payment in {currency} but the budget is in "
                                   f"{self.currency}; one budget has one currency")

        def update(market: Market) -> Market:
            if tool in market:
                return market if market.price(tool) == price else market.with_price(tool, price)
            return market.with_tool(PricedTool(tool, price))

        # The episode is the running tool's own (it may have ended meanwhile, for a late answer): made again
        # rather than refused, since refusing here would fail the call before its charge is settled.
        return self.update_episode_market(episode_id, update, create=True)

    def market_for(self, episode_id: str, state_ledger: Mapping[str, Any] | None = None) -> Market:
        episode = self.episodes.peek(episode_id)
        if episode is not None and episode.market is not None:
            return episode.market
        # A resumed episode whose market was scoped to it keeps that market.
        if state_ledger and state_ledger.get("market_scope") == "episode" and state_ledger.get("market"):
            market = Market.from_dict(state_ledger["market"])
            self.episodes.get(episode_id, state_ledger).market = market
            return market
        return self._market

    # ================================================================== ledger
    def ledger(self, state: Any, config: Mapping[str, Any] | None = None) -> BudgetLedger:
        """The episode's ledger as recorded in ``state``, merged with a live episode's charges: a snapshot
        (the run goes on without it, and changing it changes nothing of the guard's). ``config`` (the run's,
        with its ``thread_id``) finds the live episode when ``state`` has no ledger yet: a run stopped in
        its first model step (a stream its reader left, a cancel) wrote none, but may have spent."""
        snapshot = hasattr(state, "values") and hasattr(state, "next") and hasattr(state, "config")
        if snapshot:
            # graph.get_state(config): a StateSnapshot, whose .values is the state (empty for a thread never run)
            state, config = state.values, config if config is not None else state.config
        elif not (isinstance(state, Mapping) or hasattr(state, LEDGER_KEY) or hasattr(state, "messages")):
            raise GuardConfigError(
                f"ledger needs the graph's state (a dict: the run's output or agent.get_state(config).values), got "
                f"{type(state).__name__} {state!r:.80}; for a thread's live ledger pass guard.ledger({{}}, config)")
        if isinstance(config, str):
            config = {"configurable": {"thread_id": config}}
        elif config is not None:
            thread_id_of(config, "ledger", required=False)
        channel = channel_of(state)
        if channel is not None and not isinstance(channel, Mapping):
            raise GuardConfigError(f"ledger: state[{LEDGER_KEY!r}] is a {type(channel).__name__}, not the guard's "
                                   "ledger channel; pass the graph's state (agent.get_state(config).values)")
        if (channel is None and isinstance(state, Mapping) and "messages" not in state and state
                and all(isinstance(v, Mapping) and LEDGER_KEY in v for v in state.values())):
            raise GuardConfigError(
                f"ledger: got updates by node ({', '.join(map(str, state))}), a stream chunk, not the graph's state; "
                "pass agent.get_state(config) (the thread's checkpoint) or the run's output")
        if channel is None and isinstance(state, Mapping) and "configurable" in state and "messages" not in state:
            raise GuardConfigError("ledger: got a run config as the state; pass the thread's checkpoint, "
                                   "guard.ledger(agent.get_state(config)), or guard.ledger({}, config) for a run "
                                   "going on in this process")
        thread = ((config or {}).get("configurable") or {}).get("thread_id")
        if not state and not snapshot and thread is not None and self.episodes.peek(str(thread)) is None:
            # guard.ledger({}, config) is for a run going on here: a fresh ledger would say spent 0 for a thread
            # whose run ended (or that never ran here, a typo), whatever it spent. (An empty checkpoint, a thread
            # never run, did spend nothing.)
            raise GuardConfigError(
                f"ledger: no run of thread {thread!r} is going on in this process (it ended, ran elsewhere, or "
                "never ran) and the state given is empty; pass the thread's checkpoint: "
                "guard.ledger(agent.get_state(config))")
        read, live = self._read_ledger(state, config)
        return BudgetLedger.from_state(read.to_state()) if live else read

    def _read_ledger(self, state: Any, config: Mapping[str, Any] | None = None) -> tuple[BudgetLedger, bool]:
        """:meth:`ledger`, but a live episode's working copy itself (then ``True``: read it, never change it)
        when state has nothing the working copy lacks."""
        channel = channel_of(state)
        if not channel:
            thread = ((config or {}).get("configurable") or {}).get("thread_id")
            episode = self.episodes.peek(str(thread)) if thread is not None else None
            if episode is not None:
                return episode.ledger, True
            spec = self.budget_spec if isinstance(self.budget_spec, Budget) else Budget(self.budget)
            return BudgetLedger(spec, allow_overspend=not self.enforce), False
        episode = self.episodes.peek(self.episode_of(channel, config) or "")
        if episode is None:
            return BudgetLedger.from_state(channel), False
        live = episode.ledger
        known = channel.get("entries")
        if not (known and live.behind(known)) and set(channel.get("top_ups") or ()) <= live.top_ups.keys():
            return live, True
        # State holds what the working copy lacks (another branch's state, another process's charges): a
        # merged copy. Reading a ledger never changes the live episode's working copy.
        merged = BudgetLedger.from_state(live.to_state())
        merged.absorb(channel)
        return merged, False

    # ============================================================ top-ups (intent.top_ups)
    def top_up(self, config: Mapping[str, Any] | str, amount: float, *, graph: Any = None, reason: str = "",
               approved_by: str = "") -> float:
        """Raise a thread's budget by ``amount``: the only way a budget changes after it is set.

        ``config`` is the thread's config (or its id). With ``graph`` (the compiled agent)
        the top-up is written to the thread's state now (``graph.update_state``); without, at the
        thread's next model step, and only for a run going on in this process (a thread with no run
        here is a :class:`GuardConfigError`: its budget is only in its state). It is logged (``decision="top_up"``). Returns the
        new budget. On a thread paused inside a tool step, ``update_state`` makes LangGraph run
        that step's calls again on resume, a call that had finished included (it is paid again:
        it runs again); top up such a thread without ``graph`` (same process), or once it ends.
        :meth:`atop_up` is the same for an async checkpointer (``graph.aget_state`` / ``aupdate_state``).
        """
        return top_ups.top_up(self, config, amount, graph=graph, reason=reason, approved_by=approved_by)

    async def atop_up(self, config: Mapping[str, Any] | str, amount: float, *, graph: Any = None,
                      reason: str = "", approved_by: str = "") -> float:
        """:meth:`top_up`, reading and writing the thread's state with the graph's async methods (an
        ``AsyncSqliteSaver`` or ``AsyncPostgresSaver`` has no sync ones)."""
        return await top_ups.atop_up(self, config, amount, graph=graph, reason=reason, approved_by=approved_by)

    @contextlib.contextmanager
    def scope(self, config: Mapping[str, Any] | str) -> Iterator[None]:
        """Sub-agents with ``budget=FromParent(...)`` started inside carve from this thread's budget.

        For a sub-agent run from a graph node (a subgraph) rather than from a guarded tool call
        (tool calls open a scope by themselves). Carves still open when the scope ends are closed.
        """
        with top_ups.scope(self, config):
            yield

    # ============================================================ episodes (intent.lifecycle)
    @staticmethod
    def episode_of(channel: Mapping[str, Any] | None, config: Mapping[str, Any] | None) -> str | None:
        """The episode a ledger ``channel`` read in a step of ``config``'s thread belongs to (``None``: the channel
        names none): the channel's own, or, for a thread copied from another, the copy's own
        (:func:`intent.lifecycle.episode_of` says why)."""
        return lifecycle.episode_of(channel, config)

    def episode_id(self, state: Any, config: Mapping[str, Any] | None) -> str:
        return lifecycle.episode_id(self, state, config)

    def inherits_parent_ledger(self, state: Any) -> bool:
        """Whether ``state``'s ledger channel is the running parent's: a sub-agent started inside one
        of a guarded agent's tool calls with a copy of the parent's state (deepagents' ``task`` tool
        copies every state key but a few). Such a channel is not this guard's: the middleware reads
        the state as if it had none, and its first step overwrites it with the sub-agent's own.

        The same guard guarding a sub-agent inside one of its own tool calls would take the tool
        call's episode for the sub-agent's: a configuration error, raised here."""
        return lifecycle.inherits_parent_ledger(self, state)

    def prepare(self, state: Any, config: Mapping[str, Any] | None = None, *,
                offered: Sequence[Any] | None = None) -> dict[str, Any] | None:
        """Before a model call: start a new episode's oracle, release unused reservations, sync state.

        ``offered``: the tools the model is offered (the request's), to tell a call to a tool the
        agent has but the market does not price from a call to a tool that does not exist."""
        return self.prepared(state, config, offered=offered)[1]

    def prepared(self, state: Any, config: Mapping[str, Any] | None = None, *,
                 offered: Sequence[Any] | None = None) -> tuple[Episode, dict[str, Any] | None]:
        """:meth:`prepare`, also returning the episode, for a model step that gates next
        (``gate(..., episode=...)`` then skips finding it again)."""
        return lifecycle.prepared(self, state, config, offered=offered)

    def follow(self, episode: Episode, channel: Mapping[str, Any] | None, config: Mapping[str, Any] | None,
               **get: Any) -> Episode:
        """``episode`` for a step running with ``config``: made again from ``channel`` when the step runs on
        another branch of the thread than the one its working copy followed (a fork, a replay of an older
        checkpoint: :mod:`intent.lineage`), as a guard in another process would make it; the step's
        checkpoint noted. ``get``: :meth:`EpisodeRegistry.get`'s keywords for the step's branch."""
        return lifecycle.follow(self, episode, channel, config, **get)

    def _warn_unpriced(self, market: Market, offered: Sequence[Any]) -> None:
        """Warn (once per guard and tool) of each offered tool the market cannot price: the agent is
        shown it, but the guard will refuse its calls (a middleware's own tool, deepagents' file tools)."""
        for tool in offered:
            if provider_run(tool):
                continue  # the provider runs it, the gate never sees it
            name = tool_name(tool)
            if name and name not in self._warned_unpriced:
                try:
                    market.price(name)
                except UnpricedToolError:
                    self._unpriced_offered(name)

    def finish(self, state: Any, config: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """After the run: nothing stays reserved, state has every charge, the working state is dropped."""
        return lifecycle.finish(self, state, config)

    # ===================================================== the agent's model calls
    @property
    def meters_models(self) -> bool:
        """Whether the agent's model calls are charged (a price table was given, or ``charge_models``)."""
        return self.charge_models

    def metered_model(self, model: Any) -> Any:
        """A copy of ``model`` for another middleware (a summariser, a tool selector, a tool
        emulator): each of its executions is reserved before it runs and charged after, in the
        episode of the graph run it is called in, at ``model_prices``. One that does not fit is not
        made (:class:`intent.metered_models.MeteredModelRefused`). See :mod:`intent.metered_models`."""
        if not len(self.model_prices):
            raise GuardConfigError("metered_model needs model_prices (a price for this model) to charge its tokens; "
                                   "pass BudgetGuard(..., model_prices={'model-name': ModelPrice(...)})")
        from intent.metered_models import metered_copy

        self.made_metered_models = True
        return metered_copy(self, model)

    def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        """Charge every execution of the agent's model; a call that does not fit is not made."""
        return self._model_gate.wrap(request, handler)

    async def awrap_model_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        """Async twin of :meth:`wrap_model_call`."""
        return await self._model_gate.awrap(request, handler)

    def check_decision(self, answer: Decision | OracleUnavailableError, ctx: DecisionContext) -> Decision:
        """The oracle's answer, or the documented fallback when it failed recoverably.

        :meth:`decide` only ever hands over a recoverable failure (an
        :class:`~intent.errors.OracleUnavailableError`); any other exception has already left.
        """
        if isinstance(answer, BaseException):
            if self.on_oracle_error == "reject":
                return Decision.rejected(fb.oracle_failed(ctx.tool, answer, accepted=False), reason=ORACLE_ERROR)
            return Decision(True, fb.oracle_failed(ctx.tool, answer, accepted=True), (), ORACLE_ERROR,
                            {"oracle_error": 1.0})
        if not isinstance(answer, Decision):
            raise InvalidDecisionError(
                f"{type(self.oracle).__name__}.decide() (or adecide()) returned {type(answer).__name__}, not an "
                "intent.Decision; "
                "return Decision.accepted() or Decision.rejected(feedback, reason=...)"
            )
        if answer.accept is not True and answer.accept is not False:
            kind = type(answer.accept)
            if (kind.__module__, kind.__name__) not in (("numpy", "bool"), ("numpy", "bool_")):
                # Decision(accept="no") would read as truthy: the oracle's rejection would run and pay the call.
                raise InvalidDecisionError(
                    f"{type(self.oracle).__name__}: Decision.accept must be True or False, got "
                    f"{type(answer.accept).__name__} {answer.accept!r:.40}; return Decision.accepted() or "
                    "Decision.rejected(feedback, reason=...)")
            answer = dataclasses.replace(answer, accept=bool(answer.accept))  # a vectorised test's np.bool_
        return answer

    def decide(self, ctx: DecisionContext) -> Decision | OracleUnavailableError:
        """The oracle's decision, or its recoverable failure (for :meth:`check_decision`'s fallback).

        Any other exception is re-raised unchanged: a bug in an oracle must fail the run, not
        be decided by ``on_oracle_error`` (see :mod:`intent.errors`).
        """
        try:
            return self.oracle.decide(ctx)
        except Exception as exc:
            typed = _recoverable(exc, self.oracle)
            if typed is None:
                raise
            return typed

    async def adecide(self, ctx: DecisionContext) -> Decision | OracleUnavailableError:
        """Async twin of :meth:`decide`, using the oracle's ``adecide`` when it has one."""
        adecide = getattr(self.oracle, "adecide", None)
        try:
            return await adecide(ctx) if adecide is not None else self.oracle.decide(ctx)
        except Exception as exc:
            typed = _recoverable(exc, self.oracle)
            if typed is None:
                raise
            return typed

    def gate(self, state: Any, config: Mapping[str, Any] | None = None, *, settle: bool = True,
             episode: Episode | None = None) -> dict[str, Any] | None:
        """Gate the last AIMessage's tool calls (sync). Returns a state update.

        ``settle=False`` when :meth:`prepare` already ran since the last tool step (the
        middleware settles before each model call), so unused reservations are not looked for twice;
        ``episode``: the one :meth:`prepared` returned in that step, so it is not looked for again.
        """
        io: list[Any] = [None]  # each decision in, the update out (gate_batch: no StopIteration at its end)
        gen = gate_batch(self, state, config, settle, episode, io)
        try:
            for ctx in gen:
                io[0] = self.decide(ctx)  # may raise (a bug): the batch is then dropped undecided
        finally:
            gen.close()
        return io[0]

    async def agate(
        self, state: Any, config: Mapping[str, Any] | None = None, *, settle: bool = True,
        episode: Episode | None = None,
    ) -> dict[str, Any] | None:
        """Async twin of :meth:`gate`, using the oracle's ``adecide`` when it has one."""
        io: list[Any] = [None]
        gen = gate_batch(self, state, config, settle, episode, io)
        try:
            if not self.reaches_store():
                for ctx in gen:
                    io[0] = await self.adecide(ctx)
            else:
                # The gate's steps between decisions reach the shared store (what is left, the batch's
                # reservations): run in a thread, not on the event loop (intent.off_loop).
                ctx = await off_loop(next, gen, None)
                while ctx is not None:
                    io[0] = await self.adecide(ctx)
                    ctx = await off_loop(next, gen, None)
        finally:
            gen.close()
        return io[0]

    # ===================================================== running a tool call
    def wrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], ToolMessage | Command]
    ) -> ToolMessage | Command:
        """Run a gated call with a metered tool and return its answer with every charge."""
        run = lean_path.open_call(self, request) or open_call(self, request)
        if not hasattr(run, "metered_request"):
            return run  # type: ignore[return-value]  # refused before anything ran
        try:
            result = handler(run.metered_request())
        except ParentCommand as handoff:
            raise run.handed_off(handoff) from None
        except Exception as exc:
            if is_oracle_bug(exc) or isinstance(exc, InvalidBillError):
                # The re-gate crashed before the run (its reservation is given back), or a tool
                # reported a malformed bill (charged at its quote): bugs, never a tool error message.
                run.finish(None)
                raise
            result = run.failed(exc)
        return run.finish(result)

    async def awrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command]]
    ) -> ToolMessage | Command:
        """Async twin of :meth:`wrap_tool_call`."""
        if self.reaches_store():
            return await self._awrap_tool_call_on_store(request, handler)
        run = lean_path.open_call(self, request) or open_call(self, request)
        if not hasattr(run, "metered_request"):
            return run  # type: ignore[return-value]
        try:
            result = await handler(run.metered_request())
        except ParentCommand as handoff:
            raise run.handed_off(handoff) from None
        except Exception as exc:
            if is_oracle_bug(exc) or isinstance(exc, InvalidBillError):
                run.finish(None)
                raise
            result = run.failed(exc)
        return run.finish(result)

    async def _awrap_tool_call_on_store(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command]]
    ) -> ToolMessage | Command:
        """:meth:`awrap_tool_call` for a guard with a shared budget store: opening the call and closing it
        (its commits, its unused reservation released) reach the store, so they run in a thread
        (intent.off_loop); the tool runs on the loop. (No lean path: it takes no guard with a store, nor a sub-agent's.)"""
        run = await off_loop(open_call, self, request)
        if not hasattr(run, "metered_request"):
            return run  # type: ignore[return-value]
        try:
            result = await handler(run.metered_request())
        except ParentCommand as handoff:
            raise await off_loop(run.handed_off, handoff) from None
        except Exception as exc:
            if is_oracle_bug(exc) or isinstance(exc, InvalidBillError):
                await off_loop(run.finish, None)
                raise
            result = run.failed(exc)
        return await off_loop(run.finish, result)

    # ================================================= what the model is shown
    def _visible_names(self, state: Any, config: Mapping[str, Any] | None, market: Market,
                       offered: Collection[str] | None = None) -> list[str]:
        """The tools the agent may use now: priced, not banned or hidden, and (when known) offered."""
        visible = self.visible_tool_names(state, config)
        names = set(market.names) - set(market.banned) if visible is None else set(visible)
        if offered is not None:
            names &= offered
        return sorted(names)

    def _unpriced_offered(self, name: str) -> None:
        """Tell the developer, once per tool, that the model is offered a tool the market does not price."""
        if name in self._warned_unpriced:
            return
        self._warned_unpriced.add(name)
        import difflib

        # A priced name close to it that the model is not offered is most likely a typo in the market.
        close = difflib.get_close_matches(name, list(self._market.names), n=1, cutoff=0.8)
        typo = f"; the market prices {close[0]!r}: a typo of {name!r}?" if close else ""
        warnings.warn(
            f"the model is offered the tool {name!r} (a middleware's own tool, or one a market update removed?) but "
            "the market has no price "
            f"for it, so the guard refuses its calls; add PricedTool({name!r}, 0.0) to the market if it is "
            f"free, or its price{typo}", UnpricedToolWarning, stacklevel=2)

    def visible_tool_names(self, state: Any, config: Mapping[str, Any] | None = None, *,
                           episode_id: str | None = None) -> set[str] | None:
        """Tools the agent may see now: not banned, and allowed by the oracle. ``None``: no filter.
        ``episode_id``: the step's episode when the caller has it (not looked for again)."""
        if episode_id is None:
            episode_id = self.episode_id(state, config)
        market = self.market_for(episode_id, channel_of(state))
        allowed = self._call_hook("visible_tools", market, episode_id)
        if allowed is None and not market.banned:
            return None
        names = set(market.names) if allowed is None else set(allowed)
        return names - set(market.banned)

    def system_notes(self, state: Any, config: Mapping[str, Any] | None = None) -> str | None:
        if not self._has_hook("prompt_notes"):
            return None  # the no-op default: skip reading the ledger on every model call
        episode_id = self.episode_id(state, config)
        ledger = self._read_ledger(state)[0]
        return self._call_hook(
            "prompt_notes", self.market_for(episode_id, channel_of(state)), episode_id, ledger.spent,
            ledger.remaining, ledger.budget,
        )

    # =============================================================== adapters
    def middleware(self) -> Any:
        """This guard as a LangChain v1 ``AgentMiddleware`` for ``create_agent(..., middleware=[...])``."""
        from intent.middleware import BudgetGuardAfterModelMiddleware, BudgetGuardMiddleware

        if self.gate_at == "after_model":
            return BudgetGuardAfterModelMiddleware(self)
        return BudgetGuardMiddleware(self)

    def node(self) -> Any:
        """The gate as a LangGraph node (sync and async) for hand-built graphs."""
        from intent.graph import guard_node

        return guard_node(self)

    def tool_node(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        """A ``ToolNode`` whose calls are metered and charged by this guard."""
        _check_tools(tools, "tool_node")
        from intent.graph import guarded_tool_node

        return guarded_tool_node(self, tools, **kwargs)

    def route(self, state: Mapping[str, Any], *, tools: str = "tools", agent: str = "agent", end: str = "__end__") -> Any:
        """Conditional edge after :meth:`node`: ``Send`` each accepted pending call to ``tools``; back to
        ``agent`` when every call was refused; ``end`` when there is no message to gate. The calls sent are
        noted: a tool node other than :meth:`tool_node` that answers them is a :class:`GuardConfigError` at
        the next model step (:func:`intent.lifecycle.check_tool_runner`)."""
        from intent.graph import route_after_guard

        routed = route_after_guard(state, tools=tools, agent=agent, end=end)
        lifecycle.note_routed(self, state, routed)  # what a tool node that is not the guard's answered is told by it
        return routed

    def _call_hook(self, name: str, *args: Any) -> Any:
        if not self._has_hook(name):
            return None
        hook = getattr(self.oracle, name, None)
        return hook(*args) if callable(hook) else None

    def _has_hook(self, name: str) -> bool:
        """Whether the oracle has ``name`` and it is not :class:`Oracle`'s no-op default."""
        known = self._hooks.get(name)
        if known is None:
            mine = getattr(type(self.oracle), name, None)
            known = self._hooks[name] = callable(getattr(self.oracle, name, None)) and mine is not getattr(
                Oracle, name, object())
        return known


def _check_tools(tools: Any, where: str) -> None:
    """A list of tools (LangChain tools or functions), not ``None``, a string or a mapping."""
    if not is_list_arg(tools):
        raise GuardConfigError(f"{where} needs a list of tools, got {type(tools).__name__} {tools!r:.80}; pass "
                               "[tool, ...] (the agent's tools)")


def _recoverable(exc: Exception, oracle: Any) -> OracleUnavailableError | None:
    """``exc`` as a recoverable :class:`OracleUnavailableError`; ``None`` (and ``exc`` marked) for a bug.

    A ``StopIteration`` (say, a scripted model that ran out of replies) is re-raised as a
    ``RuntimeError``, as PEP 479 does in generators: the gate and the metered run are driven as
    generators, where a stray StopIteration would read as "no more calls" and skip the batch.
    """
    if isinstance(exc, StopIteration):
        err = RuntimeError(f"{type(oracle).__name__}.decide() raised StopIteration (an exhausted iterator in "
                           "the oracle or its model?)")
        setattr(err, ORACLE_BUG_MARK, True)
        raise err from exc
    typed = as_oracle_unavailable(exc, f"oracle {type(oracle).__name__}")
    if typed is None:
        setattr(exc, ORACLE_BUG_MARK, True)
    return typed


def _check_currencies(budget: Budget | FromParent, market: Market, prices: ModelPrices) -> str | None:
    """The one currency of a guard's money, or an error naming what disagrees."""
    named = {"budget": getattr(budget, "currency", None), "market": market.currency, "model_prices": prices.currency}
    given = {k: v for k, v in named.items() if v}
    if len({v.upper() for v in given.values()}) > 1:  # currency codes: "usd" is "USD"
        raise GuardConfigError(
            f"currencies disagree: {given}; a budget has one currency, so convert the prices or the budget")
    return next(iter(given.values()), None)
