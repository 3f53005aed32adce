"""The simulated agent: a documented behaviour model that plays a LangChain chat model.

It is **simulated** and every report says so. It exists so that oracles can be compared
here, on 2 CPU cores with no API keys, at thousands of episodes per minute — through the
same ``create_agent`` loop and the same ``BudgetGuard`` as a real model (there is no second
harness). It reads only what a real agent would read: the query's information needs (as a
capable model would extract them), the tools it is shown (``bind_tools``: banned or hidden
tools are invisible), the system prompt (prices and budget, when a method shows them), the
tool results, and the guard's feedback.

Behaviours (each a knob of :class:`SimAgentConfig`, all drawn from a per-episode seed):

* **Myopic expensive first calls**: on its first step it picks the premium provider with
  probability ``myopic_first``, even when prices are shown.
* **Quality over price without prices**: when no prices are shown it prefers premium, then
  mid, then cheap providers (``blind_preference``).
* **Reading prices when told**: with prices in the prompt it picks the cheapest affordable
  provider with probability ``price_adherence``.
* **Imperfect budget discipline**: only a share ``respect_budget`` of episodes keep track of
  what is left when choosing and retrying; the others know the prices but spend past the
  budget in retry loops (the Prompt failure mode the paper reports). A guard's "only X
  left" refusal is always heeded.
* **Retry loops on flaky cheap tools**: after a failed call it retries the same tool up to
  ``retry_limit`` times (drawn per episode) before switching; a retry fixes sloppy
  arguments with probability ``fix_args``.
* **Sloppy arguments**: each call mangles an argument with probability ``arg_noise``.
* **Parallel calls**: with probability ``parallel`` it proposes one call per open need in a
  single message.
* **Composite tools**: with probability ``use_composites`` it uses a tool covering several
  open needs.
* **Replanning on feedback**: a rejected tool is dropped (re-proposed once with
  probability ``insist``); an "only X left" message caps what it will spend; a predicted
  trace that names low-probability (< 0.5) steps makes it avoid those tools; a predicted
  plan it cannot afford makes it prefer cheaper, more reliable providers.
* **Budget guidelines** (BATS): a LOW tier makes it pick the cheapest provider, CRITICAL
  makes it answer; a verifier's PIVOT makes it drop the tool, SUCCESS makes it answer.
* **Following a named call**: a refusal that names the call to make instead ("Suggested
  call: tool {json arguments}") is followed on the next turn when that tool is visible. Only the
  ``optimal`` upper bound sends such a line today.
* **Search diversity** (DFSDT): "Previously tried actions at this point: a, b" makes it
  avoid those tools on this branch.
* It answers when every need is met, when nothing it could still call fits, or after
  ``max_steps`` model turns; an answer that gives up says "I give up" (DFSDT backtracks).

Token counts are a simulated estimate (characters / 4) and are labelled as such.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict

from intent.feedback import without_result_note

__all__ = ["SIMULATED_AGENT_LABEL", "NeedView", "SimAgentConfig", "SimulatedAgent", "TaskView", "looks_successful"]

SIMULATED_AGENT_LABEL = "simulated agent (behaviour model, not an LLM)"
_TIER_ORDER = ("premium", "mid", "cheap", "composite", "unknown")
_PRICE_LINE = re.compile(r"^-\s*([\w.\-]+):\s*([0-9]+(?:\.[0-9]+)?)\s*$", re.M)
_BUDGET = re.compile(r"hard budget of\s*([0-9]+(?:\.[0-9]+)?)")
_STATUS = re.compile(r"spent\s*([0-9.]+)\s*of\s*([0-9.]+);\s*([0-9.]+)\s*left")
_TRACKER = re.compile(r"<budget>([0-9.]+)/([0-9.]+)</budget>")
_TIER = re.compile(r"Budget tier (HIGH|MEDIUM|LOW|CRITICAL)")
_VERIFY = re.compile(r"\[Verify\] (SUCCESS|CONTINUE|PIVOT)")
_TRIED = re.compile(r"Previously tried actions at this point: ([^\n]+)")
_ENVELOPE_OK = re.compile(r'^\{\s*"error"\s*:\s*""\s*,\s*"response"\s*:\s*(?!""|\[\]|\{\}|null)\S')
_ONLY_LEFT = re.compile(r"only\s*([0-9.]+)\s*of the budget")
_SUGGESTED = re.compile(r"Suggested call: ([\w.\-]+) (\{.*\})\s*$", re.M)
_TRACE_ROW = re.compile(r"^\s*\d+\s*\|\s*([\w.\-]+)\s*\|\s*([0-9.]+)\s*\|\s*([0-9.]+)\s*\|", re.M)
_ERROR_START = re.compile(r"^\s*(\d{3}\b|error\b|\{\s*\"error\"\s*:\s*\"[^\"])", re.I)


@dataclass(frozen=True)
class NeedView:
    """One information need of the query, as the agent understands it."""

    id: str
    description: str
    args: Mapping[str, Any]
    providers: tuple[str, ...]


@dataclass(frozen=True)
class TaskView:
    """What the agent knows about a task before it starts."""

    task_id: str
    query: str
    needs: tuple[NeedView, ...]
    covers: Mapping[str, frozenset[str]]  # tool -> need ids it can satisfy
    tiers: Mapping[str, str]  # tool -> premium|mid|cheap|composite|unknown (read off descriptions)
    # How the agent reads a result: "entity" (a JSON payload about what it asked for) or
    # "envelope" (StableToolBench's {"error": "", "response": ...} with an empty error).
    reading: str = "entity"


@dataclass(frozen=True)
class SimAgentConfig:
    myopic_first: float = 0.5
    blind_preference: tuple[float, float, float] = (0.55, 0.3, 0.15)  # premium, mid, cheap
    price_adherence: float = 0.75
    retry_limit: tuple[int, int] = (1, 4)
    fix_args: float = 0.5
    arg_noise: float = 0.15
    parallel: float = 0.3
    use_composites: float = 0.3
    insist: float = 0.15
    respect_budget: float = 0.6
    max_steps: int = 12


def looks_successful(need: NeedView, text: str, reading: str = "entity") -> bool:
    """The agent's reading of a tool result: a JSON payload about the entity it asked for."""
    if reading == "envelope":
        body = without_result_note(text or "")
        try:
            payload = json.loads(body)
        except json.JSONDecodeError:  # StableToolBench cuts observations at 1024 characters
            return bool(_ENVELOPE_OK.match(body))
        return isinstance(payload, dict) and not payload.get("error") and bool(payload.get("response"))
    if _ERROR_START.match(text or ""):
        return False
    try:
        payload = json.loads(without_result_note(text))
    except (json.JSONDecodeError, AttributeError):
        return False
    if not isinstance(payload, dict) or payload.get("error"):
        return False
    flat = json.dumps(payload).lower()
    return all(str(v).lower() in flat for v in need.args.values())


def _stable_seed(*parts: object) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


@dataclass
class _Reading:
    """The agent's state, rebuilt from the message history at every turn."""

    step: int = 0
    satisfied: set[str] = field(default_factory=set)
    failures: dict[str, int] = field(default_factory=dict)
    last_tool_for: dict[str, str] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    avoid: set[str] = field(default_factory=set)
    prices: dict[str, float] = field(default_factory=dict)
    budget: float | None = None
    remaining: float | None = None
    spent_known: float = 0.0
    last_failed_tool: set[str] = field(default_factory=set)
    plan_too_costly: bool = False
    told_remaining: bool = False  # the guard said how much is left: always heeded
    tier: str = ""
    verified_success: bool = False
    suggestion: tuple[str, dict[str, Any]] | None = None  # from the last turn's refusals only


class SimulatedAgent(BaseChatModel):
    """A chat model whose replies come from the behaviour model above (one per episode)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    view: TaskView
    config: SimAgentConfig = SimAgentConfig()
    seed: int = 0
    visible: tuple[str, ...] | None = None

    @property
    def _llm_type(self) -> str:
        return "intent-simulated-agent"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> SimulatedAgent:
        names = tuple(t["name"] if isinstance(t, dict) else getattr(t, "name", str(t)) for t in tools)
        return self.model_copy(update={"visible": names})

    # ------------------------------------------------------------ reading
    def _read(self, messages: Sequence[BaseMessage]) -> _Reading:
        r = _Reading()
        calls: dict[str, dict[str, Any]] = {}
        # System notes first, wherever they sit (the guard puts per-turn notes after the
        # conversation, for the prefix cache): the agent reads the prompt before the history.
        ordered = [m for m in messages if isinstance(m, SystemMessage)] + [
            m for m in messages if not isinstance(m, SystemMessage)]
        for m in ordered:
            if isinstance(m, SystemMessage):
                text = str(m.content)
                r.prices.update({n: float(p) for n, p in _PRICE_LINE.findall(text)})
                if b := _BUDGET.search(text):
                    r.budget = float(b.group(1))
                if s := _STATUS.findall(text):
                    r.spent_known, r.budget, r.remaining = (float(x) for x in s[-1])
                if t := _TRACKER.findall(text):
                    r.spent_known, r.remaining = (float(x) for x in t[-1])
                if tier := _TIER.findall(text):
                    r.tier = tier[-1]
            elif isinstance(m, HumanMessage) and (tried := _TRIED.search(str(m.content))):
                for batch in tried.group(1).split(","):  # DFSDT joins a parallel batch's tools with "+"
                    for name in batch.split("+"):
                        r.avoid.add(name.strip())
            elif isinstance(m, AIMessage):
                r.step += 1
                r.suggestion = None
                for c in m.tool_calls:
                    calls[c["id"]] = c
                r.last_failed_tool = set()
            elif isinstance(m, ToolMessage):
                call = calls.get(m.tool_call_id)
                tool = call["name"] if call else (m.name or "")
                text = str(m.content)
                if m.status == "error" and not text.startswith("Error:"):
                    self._read_feedback(r, tool, text)
                    continue
                if s := _STATUS.findall(text):
                    r.spent_known, r.budget, r.remaining = (float(x) for x in s[-1])
                if t := _TRACKER.findall(text):
                    r.spent_known, r.remaining = (float(x) for x in t[-1])
                if v := _VERIFY.findall(text):
                    if v[-1] == "PIVOT":
                        r.avoid.add(tool)
                    r.verified_success = v[-1] == "SUCCESS"
                got = {n.id for n in self.view.needs if n.id in self.view.covers.get(tool, ()) and looks_successful(n, text, self.view.reading)}
                r.satisfied |= got
                for nid in self.view.covers.get(tool, ()):
                    r.last_tool_for[nid] = tool
                if not got:
                    r.failures[tool] = r.failures.get(tool, 0) + 1
                    r.last_failed_tool.add(tool)
                if tool in r.prices and r.remaining is None and r.budget is not None:
                    r.spent_known += r.prices[tool]
        if r.remaining is None and r.budget is not None:
            r.remaining = max(0.0, r.budget - r.spent_known)
        aware = random.Random(_stable_seed(self.seed, self.view.task_id, "aware")).random() < self.config.respect_budget
        if not aware and not r.told_remaining:
            r.remaining = None  # knows prices, does not keep count
        return r

    @staticmethod
    def _read_feedback(r: _Reading, tool: str, text: str) -> None:
        r.refused[tool] = r.refused.get(tool, 0) + 1
        if m := _ONLY_LEFT.search(text):
            r.remaining = float(m.group(1))
            r.told_remaining = True
        for name, price, p in _TRACE_ROW.findall(text):
            r.prices.setdefault(name, float(price))
            if float(p) < 0.5:
                r.avoid.add(name)
        if sug := _SUGGESTED.search(text):
            try:
                r.suggestion = (sug.group(1), dict(json.loads(sug.group(2))))
            except (json.JSONDecodeError, TypeError, ValueError):
                r.suggestion = None
        if "plan" in text.lower() and ("exceed" in text.lower() or "cost" in text.lower()):
            r.plan_too_costly = True

    # ------------------------------------------------------------ acting
    def _candidates(self, need: NeedView, r: _Reading, limit: int) -> list[str]:
        visible = set(self.visible) if self.visible is not None else None
        out = []
        for t in need.providers:
            if visible is not None and t not in visible:
                continue
            if r.failures.get(t, 0) > limit or t in r.avoid:
                continue
            if r.refused.get(t, 0) and not (r.refused[t] == 1 and self._rng(r, "insist", t).random() < self.config.insist):
                continue
            if r.remaining is not None and t in r.prices and r.prices[t] > r.remaining + 1e-9:
                continue
            out.append(t)
        return out

    def _rng(self, r: _Reading, *purpose: object) -> random.Random:
        return random.Random(_stable_seed(self.seed, self.view.task_id, r.step, *purpose))

    def _choose(self, need: NeedView, r: _Reading, limit: int) -> str | None:
        cands = self._candidates(need, r, limit)
        if not cands:
            return None
        last = r.last_tool_for.get(need.id)
        if last in cands and last in r.last_failed_tool and r.failures.get(last, 0) <= limit:
            return last  # the retry loop
        rng = self._rng(r, "choose", need.id)
        tier = {t: self.view.tiers.get(t, "unknown") for t in cands}
        by_quality = sorted(cands, key=lambda t: (_TIER_ORDER.index(tier[t]), t))
        knows_prices = all(t in r.prices for t in cands)
        if r.step == 0 and rng.random() < self.config.myopic_first:
            return by_quality[0]
        if knows_prices and (rng.random() < self.config.price_adherence or r.plan_too_costly or r.tier == "LOW"):
            return min(cands, key=lambda t: (r.prices[t], _TIER_ORDER.index(tier[t]), t))
        weights = dict(zip(("premium", "mid", "cheap"), self.config.blind_preference))
        w = [weights.get(tier[t], 0.1) for t in cands]
        if sum(w) <= 0:
            return by_quality[0]
        return rng.choices(cands, weights=w)[0]

    def _args(self, need_ids: Sequence[str], tool: str, r: _Reading) -> dict[str, Any]:
        rng = self._rng(r, "args", tool)
        sloppy = rng.random() < self.config.arg_noise
        if tool in r.last_failed_tool and rng.random() < self.config.fix_args:
            sloppy = False
        args: dict[str, Any] = {}
        for need in self.view.needs:
            if need.id in need_ids:
                args.update(need.args)
        if sloppy and args:
            key = rng.choice(sorted(args))
            value = str(args[key])
            args[key] = value[: max(1, len(value) // 2)].lower()
        return args

    def _decide(self, messages: Sequence[BaseMessage]) -> AIMessage:
        r = self._read(messages)
        open_needs = [n for n in self.view.needs if n.id not in r.satisfied]
        if not open_needs:
            return AIMessage(f"All the information is in: {self._answer(r)}")
        if r.step >= self.config.max_steps:
            return AIMessage(f"I give up after {r.step} steps. Partial answer: {self._answer(r)}")
        if r.tier == "CRITICAL" or r.verified_success:
            return AIMessage(f"Answering now with what I have: {self._answer(r)}")
        if r.suggestion is not None and (self.visible is None or r.suggestion[0] in self.visible):
            tool, args = r.suggestion
            return AIMessage(f"Following the suggestion, I will call {tool}.",
                             tool_calls=[{"name": tool, "args": args, "id": f"{self.view.task_id}-s{r.step}-0",
                                          "type": "tool_call"}])
        limit = random.Random(_stable_seed(self.seed, self.view.task_id, "limit")).randint(*self.config.retry_limit)
        rng = self._rng(r, "plan")
        open_ids = {n.id for n in open_needs}
        plan: list[tuple[str, list[str]]] = []
        if len(open_needs) >= 2 and rng.random() < self.config.use_composites:
            visible = set(self.visible or self.view.covers)
            composites = [t for t, cov in self.view.covers.items()
                          if len(cov & open_ids) >= 2 and t in visible and not r.refused.get(t)
                          and r.failures.get(t, 0) <= limit and t not in r.avoid
                          and (r.remaining is None or r.prices.get(t, 0) <= r.remaining)]
            if composites:
                tool = sorted(composites)[0]
                plan.append((tool, sorted(self.view.covers[tool] & open_ids)))
        if not plan:
            targets = open_needs if rng.random() < self.config.parallel else open_needs[:1]
            budget_left = r.remaining
            for need in targets:
                tool = self._choose(need, r, limit)
                if tool is None:
                    continue
                if budget_left is not None and tool in r.prices:
                    if r.prices[tool] > budget_left + 1e-9:
                        continue
                    budget_left -= r.prices[tool]
                if all(tool != t for t, _ in plan):
                    plan.append((tool, [need.id]))
            if not plan and len(targets) < len(open_needs):
                for need in open_needs[1:]:
                    tool = self._choose(need, r, limit)
                    if tool is not None:
                        plan.append((tool, [need.id]))
                        break
        if not plan:
            return AIMessage(f"I give up: I cannot get the rest within my means. Partial answer: {self._answer(r)}")
        calls, reasons = [], []
        for k, (tool, need_ids) in enumerate(plan):
            descs = [n.description for n in self.view.needs if n.id in need_ids]
            price = f" (price {r.prices[tool]:g})" if tool in r.prices else ""
            retry = " again" if tool in r.last_failed_tool else ""
            reasons.append(f"I need the {' and '.join(descs)}; I will call {tool}{retry}{price}.")
            calls.append({"name": tool, "args": self._args(need_ids, tool, r),
                          "id": f"{self.view.task_id}-s{r.step}-{k}", "type": "tool_call"})
        return AIMessage(" ".join(reasons), tool_calls=calls)

    def _answer(self, r: _Reading) -> str:
        got = [n.description for n in self.view.needs if n.id in r.satisfied]
        return "; ".join(got) if got else "no information found"

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        reply = self._decide(messages)
        prompt_chars = sum(len(str(m.content)) for m in messages) + 60 * len(self.visible or ())
        out_chars = len(str(reply.content)) + sum(len(json.dumps(c["args"])) + len(c["name"]) for c in reply.tool_calls)
        reply.usage_metadata = {
            "input_tokens": prompt_chars // 4,
            "output_tokens": out_chars // 4,
            "total_tokens": prompt_chars // 4 + out_chars // 4,
        }
        reply.response_metadata = {"model_name": "simulated-agent", "token_count": "simulated estimate (chars/4)"}
        return ChatResult(generations=[ChatGeneration(message=reply)])
