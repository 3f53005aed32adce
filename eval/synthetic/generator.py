"""Seeded procedural generation of synthetic tasks (all simulated).

``generate_tasks(n, seed)`` is a pure function of its arguments: the same arguments give
equal tasks (dataclass equality), another seed gives other tasks, and the first ``k`` tasks
of ``generate_tasks(n, seed)`` are those of ``generate_tasks(k, seed)``.

Per task:

* 1-4 needs from distinct domains (weights 20/35/30/15 %), entities drawn from the domain
  catalogue, and a query naming them ("What is the stock price of ACME and the weather in
  Oslo tomorrow?").
* Per need: one cheap flaky provider (price 5-12, success 0.25-0.5, forgiving about
  arguments), one mid provider (12-25, 0.6-0.8, brittle to imprecise arguments), one premium
  reliable provider (25-45, 0.9-0.98); with probability 0.3 an extra cheap or mid one.
* With 2+ needs, 1-2 composite tools covering 2-3 needs, priced 75-92 % of the sum of the
  covered needs' mid prices, success 0.6-0.8.
* 2-4 distractors: other functions of a task domain (``weather_basic_history``) or tools of
  a domain the task does not ask about. They satisfy nothing.
* Budget (unless given): the sum over needs of the best per-need expected cost
  ``min(price / success)`` (geometric retries), times ``budget_scale * U(0.65, 1.15)``,
  rounded. With these ranges about 80-85 % of tasks are solvable (see :mod:`.oracle_bound`).
* With probability ``event_rate``: 1-2 market events on distinct relevant tools (a price
  change x0.5..x2, a removal or a ban) at steps 1..2*n_needs. Each need keeps at least one
  provider, so every task stays reachable.
"""

from __future__ import annotations

import numbers
import random
from collections.abc import Iterable

from intent.errors import UsageError

from .domains import DOMAIN_NAMES, DOMAINS, Domain
from .world import MarketEvent, Need, Task, ToolSpec

__all__ = ["generate_task", "generate_tasks"]

_NEED_COUNT_WEIGHTS = (0.20, 0.35, 0.30, 0.15)
_CHEAP_WORDS = ("basic", "free", "lite")
_MID_WORDS = ("plus", "standard")
_PREMIUM_WORDS = ("pro", "premium")
_OPENERS = (
    ("What is ", "?"),
    ("Can you tell me ", "?"),
    ("I need ", "."),
    ("Please find ", "."),
    ("Look up ", ", please."),
)
_PRICE_FACTORS = (0.5, 0.75, 1.25, 1.5, 2.0)
_BUDGET_LO, _BUDGET_HI = 0.65, 1.15


def _check_int(value: object, name: str, minimum: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UsageError(f"{name} must be an int, got {type(value).__name__} {value!r}; {hint}")
    if int(value) < minimum:
        raise UsageError(f"{name} must be >= {minimum}, got {value!r}; {hint}")
    return int(value)


def _join(phrases: list[str]) -> str:
    if len(phrases) == 1:
        return phrases[0]
    return ", ".join(phrases[:-1]) + " and " + phrases[-1]


def _describe(tier: str, domain: Domain) -> str:
    d = domain.name
    return {
        "cheap": f"Community {d} lookup: cheap and fast, best-effort results (may be unavailable or imprecise).",
        "mid": f"Standard {d} API with broad coverage; expects precise, well-formed arguments.",
        "premium": f"Premium {d} data feed with an uptime SLA and curated data.",
    }[tier]


def _providers(rng: random.Random, need: Need, domain: Domain) -> list[ToolSpec]:
    tiers = ["cheap", "mid", "premium"]
    if rng.random() < 0.3:
        tiers.append(rng.choice(["cheap", "mid"]))
    words = {"cheap": list(_CHEAP_WORDS), "mid": list(_MID_WORDS), "premium": list(_PREMIUM_WORDS)}
    for w in words.values():
        rng.shuffle(w)
    out = []
    for tier in tiers:
        word = words[tier].pop()
        if tier == "cheap":
            price, p, sens = rng.randint(5, 12), rng.uniform(0.25, 0.5), rng.uniform(0.5, 1.0)
        elif tier == "mid":
            price, p, sens = rng.randint(12, 25), rng.uniform(0.6, 0.8), rng.uniform(1.5, 2.5)
        else:
            price, p, sens = rng.randint(25, 45), rng.uniform(0.9, 0.98), rng.uniform(1.0, 1.5)
        out.append(
            ToolSpec(
                name=f"{domain.name}_{word}_{domain.action}",
                domain=domain.name,
                covers=frozenset({need.id}),
                tier=tier,  # type: ignore[arg-type]
                price=price,
                base_success=round(p, 4),
                arg_sensitivity=round(sens, 3),
                description=_describe(tier, domain),
            )
        )
    return out


def _composites(rng: random.Random, needs: list[Need], atomic: list[ToolSpec]) -> list[ToolSpec]:
    if len(needs) < 2:
        return []
    out: list[ToolSpec] = []
    seen: set[frozenset[str]] = set()
    for _ in range(rng.randint(1, 2)):
        k = rng.randint(2, min(3, len(needs)))
        chosen = sorted(rng.sample(needs, k), key=lambda n: n.id)
        covers = frozenset(n.id for n in chosen)
        if covers in seen:
            continue
        seen.add(covers)
        mid_sum = 0
        for n in chosen:
            mid_sum += min(t.price for t in atomic if t.tier == "mid" and n.id in t.covers)
        doms = [n.domain for n in chosen]
        out.append(
            ToolSpec(
                name="_".join(doms) + "_bundle",
                domain="+".join(doms),
                covers=covers,
                tier="composite",
                price=max(1, round(mid_sum * rng.uniform(0.75, 0.92))),
                base_success=round(rng.uniform(0.6, 0.8), 4),
                arg_sensitivity=round(rng.uniform(1.0, 2.0), 3),
                description="Bundle API answering " + " and ".join(d for d in doms) + " questions in one call.",
            )
        )
    return out


def _distractors(rng: random.Random, used: list[str], pool: tuple[str, ...], taken: set[str]) -> list[ToolSpec]:
    out: list[ToolSpec] = []
    unused = [d for d in pool if d not in used] or [d for d in DOMAIN_NAMES if d not in used]
    for _ in range(rng.randint(2, 4)):
        if unused and rng.random() < 0.5:
            domain = DOMAINS[rng.choice(unused)]
            action = domain.action
        else:
            domain = DOMAINS[rng.choice(used)]
            action = rng.choice(domain.distractor_actions)
        tier = rng.choice(["cheap", "mid", "premium"])
        word = rng.choice({"cheap": _CHEAP_WORDS, "mid": _MID_WORDS, "premium": _PREMIUM_WORDS}[tier])
        name = f"{domain.name}_{word}_{action}"
        if name in taken:
            continue
        taken.add(name)
        lo, hi = {"cheap": (5, 12), "mid": (12, 25), "premium": (25, 45)}[tier]
        out.append(
            ToolSpec(
                name=name,
                domain=domain.name,
                covers=frozenset(),
                tier="distractor",
                price=rng.randint(lo, hi),
                base_success=round(rng.uniform(0.5, 0.95), 4),
                arg_sensitivity=1.0,
                description=f"{domain.name.capitalize()} {action.replace('_', ' ')} service.",
            )
        )
    return out


def _auto_budget(rng: random.Random, needs: list[Need], atomic: list[ToolSpec], scale: float) -> int:
    sensible = 0.0
    for n in needs:
        sensible += min(t.price / t.base_success for t in atomic if n.id in t.covers)
    return max(1, round(sensible * scale * rng.uniform(_BUDGET_LO, _BUDGET_HI)))


def _events(rng: random.Random, tools: list[ToolSpec], n_needs: int) -> tuple[MarketEvent, ...]:
    relevant = [t for t in tools if t.covers]
    count = rng.randint(1, 2)
    targets = rng.sample(relevant, count)
    events = []
    for t in targets:
        kind = rng.choice(["price_change", "price_change", "remove", "ban"])
        step = rng.randint(1, max(1, 2 * n_needs))
        new_price = None
        if kind == "price_change":
            new_price = max(1, round(t.price * rng.choice(_PRICE_FACTORS)))
            if new_price == t.price:
                new_price += 1
        events.append(MarketEvent(at_step=step, kind=kind, tool=t.name, new_price=new_price))  # type: ignore[arg-type]
    return tuple(sorted(events, key=lambda e: (e.at_step, e.tool)))


def generate_task(
    task_seed: int,
    *,
    task_id: str,
    budget: float | None = None,
    domains: tuple[str, ...] = DOMAIN_NAMES,
    event_rate: float = 0.0,
    max_needs: int = 4,
    budget_scale: float = 1.0,
) -> Task:
    """One task from its own seed (see the module docstring for the recipe)."""
    rng = random.Random(task_seed)
    k_max = min(max_needs, len(domains))
    weights = _NEED_COUNT_WEIGHTS[:k_max]
    k = rng.choices(range(1, k_max + 1), weights=weights)[0]
    chosen = rng.sample(list(domains), k)
    needs: list[Need] = []
    canonical: dict[str, dict[str, str]] = {}
    phrases: list[str] = []
    for i, name in enumerate(chosen):
        dom = DOMAINS[name]
        entity = dict(rng.choice(dom.entities))
        need = Need(f"n{i}_{name}", name, dom.render(dom.description, entity), dom.arg_keys)
        needs.append(need)
        canonical[need.id] = entity
        phrases.append(dom.render(dom.phrase, entity))
    opener, closer = rng.choice(_OPENERS)
    query = opener + _join(phrases) + closer

    atomic: list[ToolSpec] = []
    for need in needs:
        atomic.extend(_providers(rng, need, DOMAINS[need.domain]))
    tools = atomic + _composites(rng, needs, atomic)
    tools += _distractors(rng, chosen, tuple(domains), {t.name for t in tools})
    rng.shuffle(tools)

    b = budget if budget is not None else _auto_budget(rng, needs, atomic, budget_scale)
    events = _events(rng, tools, k) if event_rate > 0 and rng.random() < event_rate else ()
    return Task(
        task_id=task_id,
        query=query,
        needs=tuple(needs),
        tools=tuple(tools),
        budget=b,
        canonical_args=canonical,
        events=events,
        seed=task_seed,
    )


def generate_tasks(
    n: int,
    seed: int,
    *,
    budget: float | None = None,
    domains: Iterable[str] = DOMAIN_NAMES,
    event_rate: float = 0.0,
    max_needs: int = 4,
    budget_scale: float = 1.0,
) -> list[Task]:
    """``n`` tasks from ``seed``.

    ``budget`` fixes every task's budget (e.g. 50, as in the paper); otherwise it is drawn per
    task around the expected cost of a sensible plan, times ``budget_scale``. ``domains`` limits
    the need domains; ``event_rate`` is the probability that a task gets 1-2 market events;
    ``max_needs`` (1-4) caps the needs per task.
    """
    n = _check_int(n, "n", 1, "ask for at least one task, e.g. n=200")
    seed = _check_int(seed, "seed", 0, "pass a non-negative integer seed, e.g. seed=0")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Real)
                               or not 0 < float(budget) < float("inf")):
        raise UsageError(f"budget must be a number > 0, got {budget!r}; e.g. budget=50, or budget=None to draw "
                         "one per task")
    max_needs = _check_int(max_needs, "max_needs", 1, "pass 1..4")
    if max_needs > 4:
        raise UsageError(f"max_needs must be <= 4, got {max_needs}; pass 1..4")
    if isinstance(domains, str):
        domains = (domains,)
    doms = tuple(dict.fromkeys(domains))
    unknown = [d for d in doms if d not in DOMAINS]
    if not doms or unknown:
        raise UsageError(f"domains must be a non-empty subset of {DOMAIN_NAMES}; unknown: {unknown or 'none given'}")
    if isinstance(event_rate, bool) or not isinstance(event_rate, numbers.Real) or not 0.0 <= float(event_rate) <= 1.0:
        raise UsageError(f"event_rate must be a probability in [0, 1], got {event_rate!r}; e.g. event_rate=0.3")
    if isinstance(budget_scale, bool) or not isinstance(budget_scale, numbers.Real) or not float(budget_scale) > 0:
        raise UsageError(f"budget_scale must be a number > 0, got {budget_scale!r}; e.g. budget_scale=1.0")
    master = random.Random(seed)
    task_seeds = [master.getrandbits(63) for _ in range(n)]
    return [
        generate_task(
            s,
            task_id=f"syn-{seed}-{i:04d}",
            budget=budget,
            domains=doms,
            event_rate=float(event_rate),
            max_needs=max_needs,
            budget_scale=float(budget_scale),
        )
        for i, s in enumerate(task_seeds)
    ]
