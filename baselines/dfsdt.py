"""DFSDT (depth-first search-based decision tree, ToolLLM / StableToolBench) with budget pruning.

Every branch draws on **one** budget: the search holds one ledger channel and gates every
proposed call through the same :class:`~intent.BudgetGuard` (``gate`` then
``wrap_tool_call``), so no branch can spend what another already spent, and nothing bypasses
the guard. Control flow follows StableToolBench's ``DFS_woFilter``:

* pre-order DFS; expanding a node is one model call; up to ``width`` children per node;
* a re-expanded node gets a temporary diversity prompt listing its earlier children, as
  StableToolBench's does: each one's tool name, arguments and function output (a refusal
  included: it is what tells the model why that attempt failed). Its first line is
  ``Previously tried actions at this point: a, b+c`` (a parallel batch joined by ``+``), names only;
* a branch whose next call does not fit the remaining budget is **pruned** (the guard refuses
  the call; the search tries a sibling);
* an answer that gives up ("give up") backtracks; the first real answer stops the search;
* ``max_depth`` model turns per branch and ``max_llm_calls`` in total bound the search; if no
  answer is found, the last give-up answer is returned.
* ``summarize=True`` (BTP's code, which ends its search with ``summarize()``): after the search, the
  model writes the final answer from every call result the tree gathered (its branches'
  included); when it answers, that answer and a chain of those calls replace the search's own.

Three hooks serve the exhaustive search behind OR's denominator (paper B.3); the baseline
leaves them off:

* ``per_path_budget=True`` gives every branch its own copy of the budget, holding only what its
  own path spent (each branch is a separate guard episode seeded with its parent's ledger, ended
  when the search leaves the branch), so a solution is in budget when its own trajectory is;
* ``prune_partial_batches=False`` prunes a node only when none of its parallel calls could run;
  when some ran, the branch goes on with their results and the refusals (upstream, parallel
  calls are a chain of single-call nodes, and the call that does not fit prunes only itself);
* ``on_answer(messages, gave_up)`` sees every final message, give-ups included, and returns
  True to stop the search there, or False to end that branch and keep searching.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from intent.errors import UsageError
from intent.guard import BudgetGuard
from intent.ledger import merge_ledger_states
from intent.state import LEDGER_KEY
from intent.oracle import OVER_BUDGET, PLAN_OVER_BUDGET, QUOTA_EXHAUSTED

__all__ = ["DFSDTResult", "DFSDTRunner", "is_give_up"]

# Refusals that mean "this branch cannot afford its next step": prune it.
_PRUNE_REASONS = frozenset({OVER_BUDGET, PLAN_OVER_BUDGET, QUOTA_EXHAUSTED})

# StableToolBench cuts every observation at 1024 characters; an earlier attempt's output is shown as cut.
_OUTPUT_CHARS = 1024


def _diversity_prompt(tried: list[tuple[str, list[dict[str, Any]]]]) -> str:
    """The temporary prompt of a re-expanded node (StableToolBench's DIVERSITY_PROMPT, in our words)."""
    attempts = [call for _, calls in tried for call in calls]
    return (f"Previously tried actions at this point: {', '.join(names for names, _ in tried)}\n"
            "This is not the first attempt from this state, and every earlier attempt from here failed. Here they "
            "are, each with its arguments and what it returned:\n"
            f"{json.dumps(attempts, indent=2, ensure_ascii=False, default=str)}\n"
            "Analyse the current state and these attempts, then choose an action different from all of them.")


def is_give_up(message: AIMessage) -> bool:
    return "give up" in str(message.content).lower() or "give_up_and_restart" in str(message.content)


@dataclass
class DFSDTResult:
    messages: list[BaseMessage]
    answer: str | None
    llm_calls: int = 0
    nodes: int = 0
    pruned: int = 0
    backtracks: int = 0
    channel: dict[str, Any] | None = None
    tokens: int = 0
    # Calls the search submitted to the guard, and the ToolMessages the guard's tool step
    # returned for them (over every branch, kept or abandoned): the runner checks they agree.
    proposed_calls: int = 0
    answered_calls: int = 0
    cut_at_depth: int = 0  # expansions whose calls were dropped at max_depth, before the guard saw them
    summarized: bool = False  # the answer is summarize's (written from every result the search gathered)


class DFSDTRunner:
    def __init__(self, guard: BudgetGuard, tools: Sequence[Any], *, width: int = 10, max_depth: int = 12,
                 max_llm_calls: int = 200, system_prompt: str | None = None, per_path_budget: bool = False,
                 prune_partial_batches: bool = True,
                 on_answer: Callable[[list[BaseMessage], bool], bool] | None = None,
                 before_model: Callable[[], None] | None = None, summarize: bool = False) -> None:
        if width < 1 or max_depth < 1 or max_llm_calls < 1:
            raise UsageError(f"width, max_depth and max_llm_calls must be >= 1, got {width}, {max_depth}, "
                             f"{max_llm_calls}")
        self.guard = guard
        self.tools = {t.name: t for t in tools}
        self.width, self.max_depth, self.max_llm_calls = width, max_depth, max_llm_calls
        self.system_prompt = system_prompt
        self.per_path_budget, self.prune_partial_batches, self.on_answer = (per_path_budget, prune_partial_batches,
                                                                            on_answer)
        # Called before each expansion's model call (an agent's before_model hook): e.g. the benchmark's market
        # events, so the guard prices and hides tools as the market is now.
        self.before_model = before_model
        self.summarize = summarize

    # ------------------------------------------------------------ one step
    def _model_input(self, model: Any, history: list[BaseMessage],
                     tried: list[tuple[str, list[dict[str, Any]]]]) -> tuple[Any, list[BaseMessage]]:
        if self.before_model is not None:
            self.before_model()
        # Prepared as an agent's model step is (the middleware's before_model): an oracle's episode starts
        # before the first expansion, so a plan made at its start (BTP's quotas) already shapes what it sees.
        self._merge(self.guard.prepare({"messages": history, LEDGER_KEY: self._channel}, self._config,
                                       offered=list(self.tools.values())))
        state = {"messages": history, LEDGER_KEY: self._channel}
        visible = self.guard.visible_tool_names(state, self._config)
        tools = [t for n, t in self.tools.items() if visible is None or n in visible]
        notes = self.guard.system_notes(state, self._config)
        system = "\n\n".join(x for x in (self.system_prompt, notes) if x)
        messages = ([SystemMessage(system)] if system else []) + list(history)
        if tried:  # temporary: shown to the model for this expansion only
            messages.append(HumanMessage(_diversity_prompt(tried)))
        bound = model.bind_tools(tools) if tools else model
        return bound, messages

    def _merge(self, update: dict[str, Any] | None) -> list[BaseMessage]:
        if not update:
            return []
        if LEDGER_KEY in update:
            self._channel = merge_ledger_states(self._channel, update[LEDGER_KEY])
        return list(update.get("messages", []))

    def _execute(self, history: list[BaseMessage], ai: AIMessage) -> tuple[AIMessage, list[BaseMessage], bool]:
        """Gate the calls of ``ai`` against the shared ledger; each call then gets one answer
        from the guard's tool step (its result if accepted and run, its refusal otherwise)."""
        if not ai.id:
            # Sibling branches may reuse call ids; the proposing message's id keeps their keys apart.
            ai = ai.model_copy(update={"id": f"dfsdt-{uuid.uuid4().hex[:12]}"})
        state = {"messages": [*history, ai], LEDGER_KEY: self._channel}
        answered: list[BaseMessage] = []
        for m in self._merge(self.guard.gate(state, self._config)):
            if isinstance(m, AIMessage) and m.id == ai.id:
                ai = m  # the gate's copy: a duplicated call id renamed, identical calls merged into one
            else:
                answered.append(m)
        # Counted on the message as the gate left it, as the agent's history keeps it: a call merged into
        # an identical one is answered by that one's answer (it was counted, and not answered, before).
        self._result.proposed_calls += len(ai.tool_calls)
        results: list[BaseMessage] = list(answered)
        done = {m.tool_call_id for m in answered if isinstance(m, ToolMessage)}
        for call in ai.tool_calls:
            if call["id"] in done:
                continue
            request = ToolCallRequest(tool_call=call, tool=self.tools.get(call["name"]),
                                      state={"messages": [*history, ai], LEDGER_KEY: self._channel}, runtime=None)
            out = self.guard.wrap_tool_call(request, self._run_tool)
            if isinstance(out, Command):
                results += self._merge(out.update if isinstance(out.update, dict) else None)
            else:
                results.append(out)
        ran = {m.tool_call_id: m for m in results if isinstance(m, ToolMessage)
               and not (isinstance(m.artifact, dict) and "intent_reason" in m.artifact)}
        self._ran += [(call, ran[call["id"]]) for call in ai.tool_calls if call["id"] in ran]
        ids = {c["id"] for c in ai.tool_calls}
        self._result.answered_calls += sum(isinstance(m, ToolMessage) and m.tool_call_id in ids for m in results)
        over_budget = any(isinstance(m, ToolMessage) and isinstance(m.artifact, dict)
                          and m.artifact.get("intent_reason") in _PRUNE_REASONS for m in results)
        return ai, results, over_budget

    @staticmethod
    def _run_tool(request: ToolCallRequest) -> ToolMessage:
        call = request.tool_call
        out = request.tool.invoke(dict(call, type="tool_call"))
        return out if isinstance(out, ToolMessage) else ToolMessage(str(out), tool_call_id=call["id"], name=call["name"])

    # ------------------------------------------------------------- search
    def run(self, model: Any, query: str, *, episode_id: str = "dfsdt", channel: dict[str, Any] | None = None
            ) -> DFSDTResult:
        self._episode_id = episode_id
        self._config = {"configurable": {"thread_id": episode_id}}
        self._channel = channel
        self._result = DFSDTResult(messages=[], answer=None)
        self._fallback: tuple[list[BaseMessage], str] | None = None
        self._ran: list[tuple[dict[str, Any], ToolMessage]] = []  # every call that ran, with its result
        self._query = query
        root_channel, root_config = self._channel, self._config
        try:
            found = self._dfs(model, [HumanMessage(query)], depth=0)
        finally:
            # The episode ends here, as a graph's after_agent ends it: nothing stays reserved (a run that
            # raised included) and the oracle's end hook drops what it kept of the episode. (Per-path
            # branches end their own episodes in _dfs; the search may stand in the found branch's.)
            self._end(self._channel if self._config is root_config else root_channel, root_config)
        res = self._result
        if found is not None:
            res.messages, res.answer = found, str(found[-1].content)
        elif self._fallback is not None:
            res.messages, res.answer = self._fallback
        if self.summarize and self._ran:
            self._summarize(model)
        res.channel = self._channel
        return res

    def _summarize(self, model: Any) -> None:
        """BTP's ``summarize()``: the final answer written from every result the search gathered."""
        # Fresh call ids: sibling branches may have reused theirs, and each result must answer its own call.
        calls = [dict(call, id=f"summary-{i}") for i, (call, _) in enumerate(self._ran)]
        outs = [out.model_copy(update={"tool_call_id": f"summary-{i}"}) for i, (_, out) in enumerate(self._ran)]
        chain: list[BaseMessage] = [HumanMessage(self._query), AIMessage("", tool_calls=calls, id="dfsdt-summary"),
                                    *outs]
        ask = HumanMessage("These are the results of every call made for the query above. Using them, give the "
                           "final answer to the query now.")
        # Bound to the tools, as the history's calls are (some providers refuse tool calls of undeclared tools);
        # a reply that calls a tool instead of answering leaves the search's own answer.
        reply = model.bind_tools(list(self.tools.values())).invoke(
            [*([SystemMessage(self.system_prompt)] if self.system_prompt else []), *chain, ask], self._config)
        res = self._result
        res.llm_calls += 1
        res.tokens += int((reply.usage_metadata or {}).get("total_tokens", 0))
        if not reply.tool_calls and str(reply.content).strip():  # it answered: that answer stands
            res.messages, res.answer, res.summarized = [*chain, reply], str(reply.content), True

    def _end(self, channel: dict[str, Any] | None, config: dict[str, Any]) -> None:
        """End the guard episode of ``config`` (whose ledger is ``channel``); its final ledger is the
        result's only if the search stands in that episode."""
        update = self.guard.finish({"messages": [HumanMessage(self._query)], LEDGER_KEY: channel}, config)
        if config is self._config:
            self._merge(update)

    def _enter_branch(self, path: str) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """Per-path budget: the branch at ``path`` becomes its own guard episode, seeded with the
        parent's ledger (the channel); returns what to restore when the search leaves it."""
        saved = (self._channel, self._config)
        branch = f"{self._episode_id}/{path}"
        self._config = {"configurable": {"thread_id": branch}}
        if self._channel:
            self._channel = {**self._channel, "episode_id": branch}
        return saved

    def _dfs(self, model: Any, history: list[BaseMessage], depth: int, path: str = "0") -> list[BaseMessage] | None:
        res = self._result
        tried: list[tuple[str, list[dict[str, Any]]]] = []  # per earlier child: its names, its calls and outputs
        for child in range(self.width):
            if res.llm_calls >= self.max_llm_calls:
                return None
            bound, messages = self._model_input(model, history, tried)
            ai = bound.invoke(messages, self._config)
            res.llm_calls += 1
            res.nodes += 1
            res.tokens += int((ai.usage_metadata or {}).get("total_tokens", 0))
            if not ai.tool_calls:
                final = [*history, ai]
                gave_up = is_give_up(ai) or depth >= self.max_depth
                if self.on_answer(final, gave_up) if self.on_answer is not None else not gave_up:
                    return final
                if gave_up:
                    self._fallback = (final, str(ai.content))
                res.backtracks += 1
                return None  # a give-up, or an answer the caller searches past: backtrack one level
            if depth + 1 >= self.max_depth:
                res.backtracks += 1
                res.cut_at_depth += 1
                return None
            saved = self._enter_branch(f"{path}.{child}") if self.per_path_budget else None
            branch = (self._channel, self._config)
            found = None
            try:
                ai, results, over_budget = self._execute(history, ai)
                outputs = {m.tool_call_id: str(m.content) for m in results if isinstance(m, ToolMessage)}
                tried.append(("+".join(c["name"] for c in ai.tool_calls),
                              [{"name": c["name"], "arguments": c["args"],
                                "function_output": outputs.get(c["id"], "")[:_OUTPUT_CHARS]} for c in ai.tool_calls]))
                # The branch's own calls ran: its ledger is final (deeper nodes are branches of their own).
                branch = (self._channel, self._config)
                if over_budget and not self.prune_partial_batches and any(
                        isinstance(m, ToolMessage)
                        and not (isinstance(m.artifact, dict) and "intent_reason" in m.artifact) for m in results):
                    over_budget = False  # some calls ran: the branch goes on with what they returned
                if not over_budget:
                    found = self._dfs(model, [*history, ai, *results], depth + 1, f"{path}.{child}")
                else:
                    res.pruned += 1  # the next call does not fit: prune, try a sibling
            finally:
                if saved is not None:  # the branch's episode ends with it (found, abandoned, or raised)
                    self._end(*branch)
            if found is not None:
                return found
            if saved is not None:  # a sibling starts from this node's ledger, not the abandoned branch's
                self._channel, self._config = saved
        return None

