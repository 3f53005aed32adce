"""Exact budget-optimal references on the synthetic market.

* :func:`optimal_plan`: the budget-optimal success probability ``V(S, b)`` and its policy
  (the ``optimal`` gate and ``decision_regret`` use it);
* :func:`clairvoyant_plan`: whether an *episode* is solvable by a policy that knows every
  call's realised outcome: the denominator of OR (see its docstring).

Definition
----------
Assume an agent that knows the hidden success probabilities, always passes the canonical
(perfect) arguments, sees whether each call satisfied its needs (the observations make that
visible: an error or a payload about another entity is a failure), and may adapt its next call
to what has happened so far. Calls succeed independently; a successful call of tool ``t``
satisfies every need in ``t.covers``; a call costs ``price(t)`` whether it succeeds or not; the
total spend may never exceed the budget ``B``. The **budget-optimal success probability** is

    V(S, b) = 1                                                    if S contains every need
    V(S, b) = max(0, max_{t : price(t) <= b, covers(t) not in S}
                     p_t * V(S | covers(t), b - price(t)) + (1 - p_t) * V(S, b - price(t)))

(with sequential dependencies, market v2, ``covers(t)`` above means the covered needs whose
prerequisites are all in ``S``: a call cannot satisfy a need before its prerequisites are met)
evaluated at ``V({}, B)``: the best probability, over all adaptive call policies whose spend
never exceeds ``B``, that every need gets satisfied. This is an upper bound on the pass rate
of any agent (worse arguments only lower ``p_t``), and it is at least the value of the best
fixed call multiset within budget (a fixed multiset is one particular policy), which is the
weaker, open-loop notion. The recursion is computed exactly by dynamic programming over
(satisfied set, remaining budget): ``2**n_needs * (B + 1)`` states, vectorised with numpy over
budget chunks (a call costs at least the cheapest price, so a chunk of that width only depends
on smaller budgets). Ties in probability are broken by the smaller expected spend.

Which market: by default the task's **initial** market (``task.market()``), i.e. events are
ignored; pass ``market=task.market_at(step)`` (or any snapshot) to use another one. Banned or
removed tools are excluded. Prices come from the market and are rounded *up* to integers.

Solvable: ``V({}, B) >= confidence`` (default 0.5: a task is solvable when the best possible
agent solves it more often than not). The min-cost plan is the same policy computed for the
smallest budget ``b* <= B`` with ``V({}, b*) >= confidence``: no policy with a spending cap below
``b*`` reaches the confidence.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from intent.errors import UsageError
from intent.market import Market

from .world import Task

__all__ = ["DEFAULT_CONFIDENCE", "ClairvoyantPlan", "OptimalPlan", "PolicySummary", "clairvoyant_plan", "optimal_plan",
           "solvable"]

DEFAULT_CONFIDENCE = 0.5
_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class PolicySummary:
    """The optimal policy under one spending cap.

    ``ideal_path`` is the call sequence the policy makes when every call succeeds (its
    cheapest branch), ``ideal_cost`` its total price. ``expected_cost`` is the mean spend.
    """

    budget: int
    success_probability: float
    expected_cost: float
    ideal_path: tuple[str, ...]
    ideal_cost: int


@dataclass(frozen=True)
class OptimalPlan:
    """Result of :func:`optimal_plan`.

    ``success_probability`` is ``V({}, B)``; ``solvable`` is ``success_probability >= confidence``;
    ``min_budget`` is the least ``b* <= B`` with ``V({}, b*) >= confidence`` (None if unsolvable) and
    ``min_cost_plan`` the optimal policy under that cap. ``next_call`` replays the optimal policy.
    """

    task_id: str
    budget: int
    confidence: float
    success_probability: float
    expected_cost: float
    ideal_path: tuple[str, ...]
    ideal_cost: int
    solvable: bool
    min_budget: int | None
    min_cost_plan: PolicySummary | None
    _tools: tuple[str, ...] = field(default=(), repr=False, compare=False)
    _prices: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _masks: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _need_bits: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    _value: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)
    _action: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def probability(self, satisfied: Iterable[str] = (), remaining: int | None = None) -> float:
        """``V(satisfied, remaining)``: the optimal success probability from that state."""
        s = self._mask(satisfied)
        b = self.budget if remaining is None else min(int(remaining), self.budget)
        if b < 0:
            return 0.0
        if s == self._full:
            return 1.0
        return float(self._value[s][b])

    def next_call(self, satisfied: Iterable[str] = (), remaining: int | None = None) -> str | None:
        """The optimal next tool from a state, or None when no call helps (or all are satisfied)."""
        s = self._mask(satisfied)
        b = self.budget if remaining is None else min(int(remaining), self.budget)
        if s == self._full or b < 0:
            return None
        a = int(self._action[s][b])
        return None if a < 0 else self._tools[a]

    @property
    def _full(self) -> int:
        return (1 << len(self._need_bits)) - 1

    def _mask(self, satisfied: Iterable[str]) -> int:
        m = 0
        for n in satisfied:
            if n in self._need_bits:
                m |= self._need_bits[n]
        return m


def _actions(task: Task, market: Market, need_bits: dict[str, int]) -> list[tuple[str, int, float, int]]:
    """(name, integer price, success probability, need mask) of useful, undominated tools."""
    acts: list[tuple[str, int, float, int]] = []
    for t in task.tools:
        if t.name not in market or not market.is_available(t.name):
            continue
        mask = 0
        for n in t.covers:
            mask |= need_bits.get(n, 0)
        p = float(t.base_success)
        if mask == 0 or p <= 0.0:
            continue
        price = int(math.ceil(market.price(t.name) - 1e-9))
        if price < 1:
            raise UsageError(
                f"tool {t.name!r} costs {market.price(t.name)} in the market; the bound needs prices >= 1 "
                "(a free tool allows unlimited retries)"
            )
        acts.append((t.name, price, p, mask))
    # Drop dominated tools: tool j dominates i if it covers a superset, costs no more and
    # succeeds no less often (exact: swapping i for j in any policy never hurts).
    def dominates(j: int, i: int) -> bool:
        _, c_i, p_i, m_i = acts[i]
        _, c_j, p_j, m_j = acts[j]
        if (m_i & ~m_j) or c_j > c_i or p_j < p_i:
            return False
        strictly = m_j != m_i or c_j < c_i or p_j > p_i
        return strictly or j < i  # among exact twins keep the first

    keep = [a for i, a in enumerate(acts) if not any(j != i and dominates(j, i) for j in range(len(acts)))]
    return keep


def _enabled(s: int, reqs: tuple[int, ...] | None) -> int:
    """The need bits whose prerequisites are all in ``s`` (every bit when there are no dependencies)."""
    if reqs is None:
        return -1
    m = 0
    for bit, r in enumerate(reqs):
        if r & ~s == 0:
            m |= 1 << bit
    return m


def _solve(
    n_needs: int, acts: list[tuple[str, int, float, int]], budget: int, reqs: tuple[int, ...] | None = None,
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Value, expected cost and argmax-action tables for every non-full satisfied mask.

    ``reqs[i]`` is the prerequisite mask of need bit ``i`` (market v2): in state ``s`` a
    successful call satisfies only the covered needs whose prerequisites are in ``s``.
    """
    full = (1 << n_needs) - 1
    size = budget + 1
    value: dict[int, np.ndarray] = {full: np.ones(size)}
    cost: dict[int, np.ndarray] = {full: np.zeros(size)}
    action: dict[int, np.ndarray] = {full: np.full(size, -1, dtype=np.int64)}
    masks = sorted(range(full), key=lambda m: -bin(m).count("1"))  # supersets first
    for s in masks:
        en = _enabled(s, reqs)
        idx = [i for i, a in enumerate(acts) if a[3] & en & ~s]
        v = np.zeros(size)
        e = np.zeros(size)
        act = np.full(size, -1, dtype=np.int64)
        value[s], cost[s], action[s] = v, e, act
        if not idx:
            continue
        prices = np.array([acts[i][1] for i in idx], dtype=np.int64)
        probs = np.array([acts[i][2] for i in idx])
        nexts = [s | (acts[i][3] & en) for i in idx]
        # success terms, shifted by price: succ_v[k, b] = p_k * V(next_k, b - c_k) (or -inf if b < c_k)
        succ_v = np.full((len(idx), size), -np.inf)
        succ_e = np.zeros((len(idx), size))
        for k, (c, p, nx) in enumerate(zip(prices, probs, nexts)):
            if c < size:
                succ_v[k, c:] = p * value[nx][: size - c]
                succ_e[k, c:] = c + p * cost[nx][: size - c]
        cmin = int(prices.min())
        fail_p = (1.0 - probs)[:, None]
        col = np.arange(len(idx))
        lo = 0
        while lo < size:
            hi = min(size, lo + cmin)
            bs = np.arange(lo, hi)
            back = bs[None, :] - prices[:, None]  # all < lo, so already final
            ok = back >= 0
            back_c = np.where(ok, back, 0)
            vals = succ_v[:, lo:hi] + np.where(ok, fail_p * v[back_c], 0.0)
            exps = succ_e[:, lo:hi] + np.where(ok, fail_p * e[back_c], 0.0)
            best = vals.max(axis=0)
            cand = np.where(vals >= best[None, :] - _EPS, exps, np.inf)
            pick = cand.argmin(axis=0)
            useful = best > _EPS
            v[lo:hi] = np.where(useful, best, 0.0)
            e[lo:hi] = np.where(useful, exps[pick, np.arange(hi - lo)], 0.0)
            act[lo:hi] = np.where(useful, np.array(idx)[col[pick]], -1)
            lo = hi
    return value, cost, action


def _summary(
    budget: int, value: dict[int, np.ndarray], cost: dict[int, np.ndarray], action: dict[int, np.ndarray],
    acts: list[tuple[str, int, float, int]], full: int, reqs: tuple[int, ...] | None = None,
) -> PolicySummary:
    s, b = 0, budget
    path: list[str] = []
    spent = 0
    while s != full and b >= 0:
        a = int(action[s][b])
        if a < 0:
            break
        name, c, _, m = acts[a]
        path.append(name)
        spent += c
        s |= m & _enabled(s, reqs)
        b -= c
    p0 = 1.0 if full == 0 else float(value[0][budget])
    e0 = 0.0 if full == 0 else float(cost[0][budget])
    return PolicySummary(budget, p0, e0, tuple(path), spent)


def _requirement_masks(task: Task, need_bits: dict[str, int]) -> tuple[int, ...] | None:
    """Per need bit, the mask of its prerequisites; None without dependencies (v1: unchanged DP)."""
    if not task.has_dependencies:
        return None
    out = []
    for n in task.needs:
        m = 0
        for r in n.requires:
            m |= need_bits[r]
        out.append(m)
    return tuple(out)


def optimal_plan(
    task: Task,
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    market: Market | None = None,
    budget: int | None = None,
) -> OptimalPlan:
    """Exact budget-optimal success probability and policy for ``task`` (see module docstring).

    ``market`` defaults to the initial snapshot (events ignored); ``budget`` to ``task.budget``.
    """
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 <= confidence <= 1.0:
        raise UsageError(f"confidence must be a probability in [0, 1], got {confidence!r}; e.g. confidence=0.5")
    given = task.budget if budget is None else budget
    if isinstance(given, bool) or not isinstance(given, (int, float)) or not 0 <= given < float("inf"):
        raise UsageError(f"budget must be a finite number >= 0, got {given!r}")
    b_total = int(math.floor(given + 1e-9))  # prices are integers: a fractional rest buys nothing
    mkt = task.market() if market is None else market
    need_bits = {n.id: 1 << i for i, n in enumerate(task.needs)}
    full = (1 << len(task.needs)) - 1
    acts = _actions(task, mkt, need_bits)
    reqs = _requirement_masks(task, need_bits)
    value, cost, action = _solve(len(task.needs), acts, b_total, reqs)
    top = _summary(b_total, value, cost, action, acts, full, reqs)
    curve = value[0]
    reach = np.nonzero(curve >= confidence - _EPS)[0]
    min_budget = int(reach[0]) if len(reach) else None
    cheapest = None
    if min_budget is not None:
        cheapest = _summary(min_budget, value, cost, action, acts, full, reqs)
    return OptimalPlan(
        task_id=task.task_id,
        budget=b_total,
        confidence=float(confidence),
        success_probability=top.success_probability,
        expected_cost=top.expected_cost,
        ideal_path=top.ideal_path,
        ideal_cost=top.ideal_cost,
        solvable=min_budget is not None,
        min_budget=min_budget,
        min_cost_plan=cheapest,
        _tools=tuple(a[0] for a in acts),
        _prices=tuple(a[1] for a in acts),
        _masks=tuple(a[3] for a in acts),
        _need_bits=need_bits,
        _value=value,
        _action=action,
    )


def solvable(task: Task, *, confidence: float = DEFAULT_CONFIDENCE, market: Market | None = None) -> bool:
    """True iff the budget-optimal success probability of ``task`` is at least ``confidence``."""
    return optimal_plan(task, confidence=confidence, market=market).solvable


@dataclass(frozen=True, slots=True)
class ClairvoyantPlan:
    """The cheapest way to solve one *episode* when every call's outcome is known in advance.

    ``calls`` lists the calls in order (a tool repeated until its first success); ``cost`` is
    their total price; ``solvable`` says whether that cost fits the budget.
    """

    task_id: str
    seed: int
    budget: float
    solvable: bool
    cost: int | None
    calls: tuple[str, ...]


def clairvoyant_plan(task: Task, seed: int, *, market: Market | None = None) -> ClairvoyantPlan:
    """OR's denominator on the synthetic market: can a policy that knows each call's realised
    outcome solve this episode (``task`` under episode ``seed``) within the budget?

    The environment draws the outcome of the ``k``-th call of a tool from ``(task, seed, tool, k)``
    (see :mod:`.executor`); with the canonical arguments a call satisfies every need its tool
    covers exactly when the service is up. So knowing the outcomes, the cheapest way to get a
    tool's needs is to call it until its first success, at ``price * (k + 1)``, and the cheapest
    way to solve the episode is the cheapest set of tools whose covers add up to every need: an
    exact set-cover dynamic program over need masks. A clairvoyant agent following ``calls``
    scores 100 on every solvable episode, so OR <= 100 is attainable.

    Market events are ignored (the initial market, or ``market``): the bound is exact for
    static markets. With sequential dependencies (market v2) the calls are listed prerequisites
    first; tasks whose multi-need tools touch a dependency are refused (ValueError).
    """
    from .executor import SyntheticEnvironment

    if task.has_dependencies:
        _check_clairvoyant_dependencies(task)
    env = SyntheticEnvironment(task, seed)
    mkt = task.market() if market is None else market
    need_bits = {n.id: 1 << i for i, n in enumerate(task.needs)}
    full = (1 << len(task.needs)) - 1
    cap = int(math.floor(task.budget + 1e-9))
    options: list[tuple[int, int, str, int]] = []  # (cost to first success, need mask, tool, calls)
    for t in task.tools:
        if t.name not in mkt or not mkt.is_available(t.name):
            continue
        mask = 0
        for n in t.covers:
            mask |= need_bits.get(n, 0)
        price = int(math.ceil(mkt.price(t.name) - 1e-9))
        if mask == 0 or price < 1:
            continue
        for k in range(cap // price):
            if env._u(t.name, k, "service") < t.base_success:
                options.append(((k + 1) * price, mask, t.name, k + 1))
                break
    best: dict[int, tuple[int, tuple[tuple[str, int], ...]]] = {0: (0, ())}
    for cost, mask, name, n_calls in sorted(options, key=lambda o: (o[0], o[2])):
        for have, (spent, picks) in list(best.items()):
            new, total = have | mask, spent + cost
            if new != have and total <= cap and (new not in best or total < best[new][0]):
                best[new] = (total, (*picks, (name, n_calls)))
    if full not in best:
        return ClairvoyantPlan(task.task_id, seed, float(task.budget), False, None, ())
    total, picks = best[full]
    if task.has_dependencies:
        picks = _dependency_order(task, picks)
    return ClairvoyantPlan(task.task_id, seed, float(task.budget), True, total,
                           tuple(name for name, n in picks for _ in range(n)))


def _related(task: Task) -> set[str]:
    """Needs that take part in a dependency (as prerequisite or as dependent)."""
    out: set[str] = set()
    for n in task.needs:
        if n.requires:
            out.add(n.id)
            out.update(n.requires)
    return out


def _check_clairvoyant_dependencies(task: Task) -> None:
    # The set-cover program below stays exact with dependencies when every tool that touches a
    # dependency covers that one need only: each useful tool is then called to its first success
    # once, and any chosen set can be run prerequisites first (a dependent need's provider is
    # simply called after its prerequisite's). Market v2's generator keeps bundles off
    # dependencies for exactly this reason; other tasks get a clear refusal, not a wrong bound.
    related = _related(task)
    for t in task.tools:
        if len(t.covers) > 1 and t.covers & related:
            raise UsageError(
                f"clairvoyant_plan: tool {t.name!r} of task {task.task_id!r} covers {sorted(t.covers)}, including "
                f"needs in a dependency ({sorted(t.covers & related)}); the exact bound supports dependencies only "
                "when the tools touching them cover a single need (use optimal_plan for the expected-value bound)"
            )


def _dependency_order(task: Task, picks: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    """``picks`` reordered so that each need's prerequisites are satisfied first (stable otherwise)."""
    depth: dict[str, int] = {}

    def level(nid: str) -> int:
        if nid not in depth:
            depth[nid] = 1 + max((level(r) for r in task.need(nid).requires), default=-1)
        return depth[nid]

    def key(item: tuple[int, tuple[str, int]]) -> tuple[int, int]:
        i, (name, _) = item
        spec = task.tool(name)
        return (max((level(n) for n in spec.covers), default=0) if spec else 0, i)

    return tuple(p for _, p in sorted(enumerate(picks), key=key))
