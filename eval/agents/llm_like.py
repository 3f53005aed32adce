"""The pre-registered, LLM-like simulated agent (``--agent sim-llm``; issue 16, section 2).

Simulated, like :mod:`eval.agents.simulated` (which stays as ``--agent sim``), and labelled so.
It reads only what a real agent reads: the query's needs (and, on market v2, which need takes
another's result as its argument: the query says "then, using that result"), the tools it is
shown with their descriptions, the system prompt (prices, budget, status when a method shows
them), tool results and the guard's feedback. It never reads hidden success probabilities.

Behaviour model
---------------
* **Beliefs.** Per tool, a belief of its success probability: the prior of its tier as read
  off the description (``tier_prior``), plus per-episode noise (``belief_noise``, logit scale),
  updated like a Beta posterior worth ``prior_strength`` calls by every result it reads
  (success = a payload about the entity it asked for). A price belief: the listed price
  (misread by ``price_noise``, relative) when prices are shown, none otherwise.
* **Noisy-rational choice.** Each turn it scores every visible provider of an open need:
  ``utility = covered_open_needs * p_belief - cost_weight * price / budget - penalty`` (the
  cost term only when it knows prices and a budget) and samples one by a softmax with
  ``temperature``. With probability ``parallel`` it proposes one call per open need at once.
* **Feedback is information, never a permanent ban.** A refusal adds ``reject_penalty`` to
  that tool, halving every later turn; "only X of the budget is left" sets what it believes is
  left (and it drops what it cannot afford); a predicted trace's ``p_success`` column moves its
  belief halfway to the trace's value; a plan whose expected or risk-adjusted cost exceeds the
  budget multiplies its ``cost_weight`` by ``cost_alarm``; a "Suggested call: tool {args}" is
  followed with probability ``follow_suggestion``; a 400 saying the arguments come from
  another need's result teaches it that dependency.
* **Budget discipline.** With prices and status shown, a share ``track_budget`` of episodes
  keeps count of what is left and never proposes a call it thinks it cannot afford; the others
  know the prices but not the balance (the Prompt failure mode). A guard's "only X left" is
  always heeded.
* **Dependencies.** A share ``respect_dependencies`` of episodes waits for a prerequisite's
  result before calling a dependent need's provider; the others learn it from the 400.
* **Budget anxiety.** When it sees the balance (a status line), each turn it answers with what
  it has with probability ``quit_rate * spent / budget``.
* **Answering.** When every need looks met; when no candidate is affordable; when its best
  candidate's belief is below ``give_up_below``; or after ``max_steps`` turns ("I give up").
* **Arguments.** Canonical, mangled with probability ``arg_noise`` (a half-typed value).

Random streams: every draw is a hash of ``(seed, stream, task, turn, purpose)``. The agent in
the episode uses ``rand_stream="agent"``; :meth:`LLMLikeAgent.for_rollout` returns a copy with
another stream (and its own belief noise), which is what an oracle's rollout policy gets
(``eval.oracle_methods._policy``): a rollout never replays the agent's own future draws.

Calibration (done once, then frozen; the parameters below are the frozen ones)
------------------------------------------------------------------------------
Target: the paper's Raw and Prompt rows (Table 1, GPT-4.1-mini, B = 50) as ratios, since the
market differs: Raw PR 19.1 FR 34.5 AC 102.1 AP 28.2 (3.6 calls/task); Prompt PR 30.9 FR 67.2
AC 43.4 AP 24.2 (1.8 calls/task); Prompt/Raw: PR x1.6, FR x1.9, AC x0.43, calls x0.5.
Command::

    intent bench --market synthetic-v2 --agent sim-llm --methods raw,prompt --tasks 200 \\
        --workers 2 --seed 0 --out runs/calib-sim-llm

CALIBRATION_RESULT below records what that command printed with these parameters:

    ======  =====  =====  =====  =====  ==========  (paper, B = 50)
    method  PR     FR     AC     AP     calls/task
    raw     21.0   21.0   75.84  18.96  4.0         PR 19.1 FR 34.5 AC 102.1 calls 3.6
    prompt  31.0   68.0   49.88  15.05  3.3         PR 30.9 FR 67.2 AC 43.4  calls 1.8
    ======  =====  =====  =====  =====  ==========

Prompt/Raw: PR x1.48 (paper x1.62), FR x3.2 (x1.95), AC x0.66 (x0.43), calls x0.83 (x0.5).
PR and FR land on the paper's absolute values for Prompt and PR for Raw; known misses, left
as they are (the parameters are frozen, not re-tuned): Raw overspends more often (FR 21 vs
34.5) but by less (AC 1.5 B vs 2 B), and Prompt makes more, cheaper calls than the paper's
(the cheap traps of market v2 invite retries). Seven grid points were tried, once, before
freezing (temperature 0.12-0.3, cost_weight 0.15-1.0, quit_rate 0.2-1.0, track_budget
0.4-0.6, tier priors); none used an oracle's result.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

from eval.agents.simulated import (
    _BUDGET,
    _PRICE_LINE,
    _STATUS,
    _SUGGESTED,
    _TIER,
    _TRACE_ROW,
    _TRACKER,
    _TRIED,
    _VERIFY,
    SimulatedAgent,
    TaskView,
    _stable_seed,
    looks_successful,
)
from intent.errors import UsageError

__all__ = ["CALIBRATION_RESULT", "LLM_AGENT_LABEL", "LLMAgentConfig", "LLMLikeAgent", "TaskViewV2",
           "llm_agent_factory"]

LLM_AGENT_LABEL = "simulated LLM-like agent (noisy-rational behaviour model, pre-registered; not an LLM)"
CALIBRATION_RESULT = {  # the calibration command's table (200 tasks, seed 0), frozen 2026-11-23
    "raw": {"PR": 21.0, "FR": 21.0, "AC": 75.84, "AP": 18.96, "calls_per_task": 4.0},
    "prompt": {"PR": 31.0, "FR": 68.0, "AC": 49.88, "AP": 15.05, "calls_per_task": 3.31},
}

_ONLY_LEFT = re.compile(r"only\s*([0-9.]+)\s*(?:of the budget|is left)")
_REMAINING = re.compile(r"Remaining budget:\s*([0-9.]+)")
_PLAN_COST = re.compile(r"(?:risk-adjusted cost of your current plan[^:]*:|continuation of your plan costs)\s*([0-9.]+)")
_DEPENDENCY = re.compile(r"come from the result of")


@dataclass(frozen=True)
class TaskViewV2(TaskView):
    """A :class:`TaskView` that also says which need takes which other need's result (market v2)."""

    requires: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class LLMAgentConfig:
    # Frozen by the calibration in the module docstring; do not tune against an oracle.
    temperature: float = 0.25
    tier_prior: tuple[tuple[str, float], ...] = (
        ("cheap", 0.5), ("mid", 0.8), ("premium", 0.82), ("composite", 0.75), ("unknown", 0.5))
    belief_noise: float = 0.6
    prior_strength: float = 2.0
    price_noise: float = 0.1
    cost_weight: float = 0.5
    cost_alarm: float = 2.0
    reject_penalty: float = 0.4
    follow_suggestion: float = 0.85
    track_budget: float = 0.4
    respect_dependencies: float = 0.8
    give_up_below: float = 0.12
    quit_rate: float = 0.2
    parallel: float = 0.25
    arg_noise: float = 0.1
    max_steps: int = 12

    def __post_init__(self) -> None:
        for name in ("temperature", "prior_strength", "cost_alarm"):
            if not float(getattr(self, name)) > 0:
                raise UsageError(f"LLMAgentConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("belief_noise", "price_noise", "cost_weight", "reject_penalty"):
            if not float(getattr(self, name)) >= 0:
                raise UsageError(f"LLMAgentConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("follow_suggestion", "track_budget", "respect_dependencies", "give_up_below", "quit_rate",
                     "parallel", "arg_noise"):
            if not 0.0 <= float(getattr(self, name)) <= 1.0:
                raise UsageError(f"LLMAgentConfig.{name} must be a probability in [0, 1], got {getattr(self, name)!r}")
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise UsageError(f"LLMAgentConfig.max_steps must be an int >= 1, got {self.max_steps!r}")


@dataclass
class _Beliefs:
    step: int = 0
    satisfied: set[str] = field(default_factory=set)
    calls: dict[str, int] = field(default_factory=dict)
    successes: dict[str, int] = field(default_factory=dict)
    trace_p: dict[str, float] = field(default_factory=dict)
    rejected_at: dict[str, list[int]] = field(default_factory=dict)
    prices: dict[str, float] = field(default_factory=dict)
    budget: float | None = None
    remaining: float | None = None
    told_remaining: bool = False
    cost_weight_factor: float = 1.0
    learned_requires: dict[str, set[str]] = field(default_factory=dict)
    suggestion: tuple[str, dict[str, Any]] | None = None
    answer_now: bool = False


class LLMLikeAgent(SimulatedAgent):
    """A chat model whose replies come from the noisy-rational behaviour model above."""

    llm: LLMAgentConfig = LLMAgentConfig()
    rand_stream: str = "agent"

    @property
    def _llm_type(self) -> str:
        return "intent-simulated-llm-like-agent"

    def for_rollout(self) -> LLMLikeAgent:
        """The copy an oracle's rollout policy uses: its own random stream (and belief noise)."""
        return self.model_copy(update={"rand_stream": "rollout"})

    # ------------------------------------------------------------ randomness
    def _rand(self, *purpose: object) -> random.Random:
        return random.Random(_stable_seed(self.seed, self.rand_stream, self.view.task_id, *purpose))

    def _prior(self, tool: str) -> float:
        tiers = dict(self.llm.tier_prior)
        p0 = tiers.get(self.view.tiers.get(tool, "unknown"), tiers.get("unknown", 0.5))
        z = math.log(p0 / (1 - p0)) + self._rand("belief", tool).gauss(0.0, self.llm.belief_noise)
        return 1.0 / (1.0 + math.exp(-z))

    # ------------------------------------------------------------ reading
    def _read_beliefs(self, messages: Sequence[BaseMessage]) -> _Beliefs:
        b = _Beliefs()
        calls: dict[str, dict[str, Any]] = {}
        ordered = [m for m in messages if isinstance(m, SystemMessage)] + [
            m for m in messages if not isinstance(m, SystemMessage)]
        for m in ordered:
            if isinstance(m, SystemMessage):
                text = str(m.content)
                b.prices.update({n: float(p) for n, p in _PRICE_LINE.findall(text)})
                if x := _BUDGET.search(text):
                    b.budget = float(x.group(1))
                if s := _STATUS.findall(text):
                    _, budget, left = (float(v) for v in s[-1])
                    b.budget, b.remaining = budget, left
                if t := _TRACKER.findall(text):  # BATS: <budget>used/remaining</budget>
                    b.remaining = float(t[-1][1])
                if tier := _TIER.findall(text):
                    b.answer_now = b.answer_now or tier[-1] == "CRITICAL"
            elif isinstance(m, HumanMessage) and (tried := _TRIED.search(str(m.content))):
                for batch in tried.group(1).split(","):
                    for name in batch.split("+"):
                        b.rejected_at.setdefault(name.strip(), []).append(b.step)
            elif isinstance(m, AIMessage):
                b.step += 1
                b.suggestion = None
                for c in m.tool_calls:
                    calls[c["id"]] = c
            elif isinstance(m, ToolMessage):
                call = calls.get(m.tool_call_id)
                tool = call["name"] if call else (m.name or "")
                text = str(m.content)
                if m.status == "error" and not text.startswith("Error:"):
                    self._read_feedback(b, tool, text)
                    continue
                if s := _STATUS.findall(text):
                    _, budget, left = (float(v) for v in s[-1])
                    b.budget, b.remaining = budget, left
                if t := _TRACKER.findall(text):
                    b.remaining = float(t[-1][1])
                if v := _VERIFY.findall(text):
                    if v[-1] == "PIVOT":
                        b.rejected_at.setdefault(tool, []).append(b.step)
                    b.answer_now = b.answer_now or v[-1] == "SUCCESS"
                covered = [n for n in self.view.needs if n.id in self.view.covers.get(tool, ())]
                if _DEPENDENCY.search(text):
                    # Not the tool's fault: the arguments needed another need's result first.
                    for n in covered:
                        if n.id not in b.satisfied:
                            b.learned_requires.setdefault(n.id, set()).update(self._requires_of(n.id))
                    continue
                got = {n.id for n in covered if looks_successful(n, text, self.view.reading)}
                b.satisfied |= got
                b.calls[tool] = b.calls.get(tool, 0) + 1
                b.successes[tool] = b.successes.get(tool, 0) + (1 if got else 0)
        return b

    def _requires_of(self, need_id: str) -> tuple[str, ...]:
        return tuple(getattr(self.view, "requires", {}).get(need_id, ()))

    def _read_feedback(self, b: _Beliefs, tool: str, text: str) -> None:
        b.rejected_at.setdefault(tool, []).append(b.step)
        if m := _ONLY_LEFT.search(text):
            b.remaining, b.told_remaining = float(m.group(1)), True
        if m := _REMAINING.search(text):
            b.remaining, b.told_remaining = float(m.group(1)), True
        for name, price, p in _TRACE_ROW.findall(text):
            b.prices.setdefault(name, float(price))
            b.trace_p[name] = float(p)
        if (m := _PLAN_COST.search(text)) and b.remaining is not None and float(m.group(1)) > b.remaining:
            b.cost_weight_factor *= self.llm.cost_alarm
        if sug := _SUGGESTED.search(text):
            try:
                b.suggestion = (sug.group(1), dict(json.loads(sug.group(2))))
            except (json.JSONDecodeError, TypeError, ValueError):
                b.suggestion = None

    # ------------------------------------------------------------ acting
    def _belief_p(self, b: _Beliefs, tool: str) -> float:
        k = self.llm.prior_strength
        p = (k * self._prior(tool) + b.successes.get(tool, 0)) / (k + b.calls.get(tool, 0))
        if tool in b.trace_p:
            p = 0.5 * p + 0.5 * b.trace_p[tool]
        return p

    def _price(self, b: _Beliefs, tool: str) -> float | None:
        if tool not in b.prices:
            return None
        return b.prices[tool] * (1.0 + self._rand("price", tool).uniform(-1, 1) * self.llm.price_noise)

    def _blocked(self, b: _Beliefs, need_id: str, respects: bool) -> bool:
        reqs = set(b.learned_requires.get(need_id, set()))
        if respects:
            reqs |= set(self._requires_of(need_id))
        return not reqs <= b.satisfied

    def _decide(self, messages: Sequence[BaseMessage]) -> AIMessage:
        b = self._read_beliefs(messages)
        open_needs = [n for n in self.view.needs if n.id not in b.satisfied]
        if not open_needs:
            return AIMessage(f"All the information is in: {self._answer_text(b)}")
        if b.step >= self.llm.max_steps:
            return AIMessage(f"I give up after {b.step} steps. Partial answer: {self._answer_text(b)}")
        if b.answer_now:
            return AIMessage(f"Answering now with what I have: {self._answer_text(b)}")
        visible = set(self.visible) if self.visible is not None else set(self.view.covers)
        if b.suggestion is not None and b.suggestion[0] in visible and \
                self._rand(b.step, "follow").random() < self.llm.follow_suggestion:
            tool, args = b.suggestion
            return AIMessage(f"Following the suggestion, I will call {tool}.",
                             tool_calls=[{"name": tool, "args": args, "id": f"{self.view.task_id}-s{b.step}-0",
                                          "type": "tool_call"}])
        if b.budget and b.remaining is not None and b.step > 0:
            # Budget anxiety: seeing the balance shrink, it may answer with what it has, the more
            # likely the more it has spent (only when the status is shown: Raw never sees it).
            spent_share = min(1.0, max(0.0, 1.0 - b.remaining / b.budget))
            if self._rand(b.step, "quit").random() < self.llm.quit_rate * spent_share:
                return AIMessage(f"I have spent most of the budget; answering with what I have: "
                                 f"{self._answer_text(b)}")
        tracks = bool(b.prices) and b.budget is not None and \
            self._rand("track").random() < self.llm.track_budget
        left = b.remaining if (tracks or b.told_remaining) else None
        respects = self._rand("deps").random() < self.llm.respect_dependencies
        workable = [n for n in open_needs if not self._blocked(b, n.id, respects)] or open_needs[:1]
        open_ids = {n.id for n in workable}
        weight = self.llm.cost_weight * b.cost_weight_factor
        scored: dict[str, tuple[float, float, list[str]]] = {}  # tool -> (utility, p belief, needs)
        for tool, cov in self.view.covers.items():
            gets = sorted(cov & open_ids)
            if not gets or tool not in visible:
                continue
            price = self._price(b, tool)
            if left is not None and price is not None and b.prices[tool] > left + 1e-9:
                continue
            p = self._belief_p(b, tool)
            u = len(gets) * p
            if price is not None and b.budget:
                u -= weight * price / b.budget
            u -= sum(self.llm.reject_penalty * 0.5 ** (b.step - s) for s in b.rejected_at.get(tool, ()))
            scored[tool] = (u, p, gets)
        if not scored or max(p for _, p, _ in scored.values()) < self.llm.give_up_below:
            return AIMessage(f"I cannot get the rest within my means; answering with what I have: "
                             f"{self._answer_text(b)}")
        rng = self._rand(b.step, "choose")
        plan: list[tuple[str, list[str]]] = []
        targets = sorted(open_ids) if rng.random() < self.llm.parallel else [None]
        budget_left = left
        taken: set[str] = set()
        for target in targets:
            options = {t: v for t, v in scored.items() if (target is None or target in v[2])
                       and not (set(v[2]) & taken)
                       and (budget_left is None or t not in b.prices or b.prices[t] <= budget_left + 1e-9)}
            if not options:
                continue
            tool = self._softmax(rng, options)
            plan.append((tool, options[tool][2]))
            taken |= set(options[tool][2])
            if budget_left is not None and tool in b.prices:
                budget_left -= b.prices[tool]
        if not plan:
            return AIMessage(f"I cannot afford another call; answering with what I have: {self._answer_text(b)}")
        calls, reasons = [], []
        for k, (tool, need_ids) in enumerate(plan):
            descs = [n.description for n in self.view.needs if n.id in need_ids]
            price = f" (price {b.prices[tool]:g})" if tool in b.prices else ""
            reasons.append(f"I need the {' and '.join(descs)}; I will call {tool}{price}.")
            calls.append({"name": tool, "args": self._make_args(need_ids, tool, b),
                          "id": f"{self.view.task_id}-s{b.step}-{k}", "type": "tool_call"})
        return AIMessage(" ".join(reasons), tool_calls=calls)

    def _softmax(self, rng: random.Random, options: Mapping[str, tuple[float, float, list[str]]]) -> str:
        names = sorted(options)
        top = max(options[t][0] for t in names)
        weights = [math.exp((options[t][0] - top) / self.llm.temperature) for t in names]
        return rng.choices(names, weights=weights)[0]

    def _make_args(self, need_ids: Sequence[str], tool: str, b: _Beliefs) -> dict[str, Any]:
        rng = self._rand(b.step, "args", tool)
        args: dict[str, Any] = {}
        for need in self.view.needs:
            if need.id in need_ids:
                args.update(need.args)
        if args and rng.random() < self.llm.arg_noise:
            key = rng.choice(sorted(args))
            value = str(args[key])
            args[key] = value[: max(1, len(value) // 2)].lower()
        return args

    def _answer_text(self, b: _Beliefs) -> str:
        got = [n.description for n in self.view.needs if n.id in b.satisfied]
        return "; ".join(got) if got else "no information found"


def llm_agent_factory(config: Mapping[str, Any] | None = None) -> Any:
    """The ``--agent sim-llm`` factory: one agent per episode, seeded by the episode seed."""
    cfg = LLMAgentConfig(**dict(config or {}))

    def build(env: Any, seed: int) -> LLMLikeAgent:
        return LLMLikeAgent(view=env.view, llm=cfg, seed=seed)

    return build
