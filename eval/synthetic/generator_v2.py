"""Market v2: seeded synthetic tasks where foresight pays (issue 16, section 1; all simulated).

Selected by ``--market synthetic-v2`` (:class:`eval.markets.SyntheticV2BenchMarket`); the v1
generator (:mod:`.generator`) is unchanged. Ground truth stays exact: every tool still has one
hidden success probability per task, so :func:`.optimal_plan` (DP over satisfied sets, now
dependency-aware), :func:`.clairvoyant_plan`, the ``optimal`` gate and decision regret all apply.

Budgets are **50-equivalent**: the budget is ``B = 50 * budget_scale`` (or the ``budget``
given) and every price is drawn relative to it, with the per-need price unit
``u = B / (n_needs * U(1.05, 1.5))`` (one reliable call per need fits, with 5-50 % slack).

Per task (1-4 needs, weights 10/35/35/20 %):

* **Sequential dependencies** (CostBench-style): with 2+ needs, probability 0.6 that a later
  need takes an earlier one's result as its argument (``Need.requires``), and with 3+ needs
  probability 0.3 of a second one. A dependent need's providers fail ("400 ... come from the
  result of ...") until its prerequisite is satisfied. The query says so ("then, using that
  result, ..."). An early expensive call can starve a later mandatory one.
* **Cost traps**, per need:
  - a cheap-but-unreliable provider (price ``u * U(0.25, 0.4)``, success ``U(0.1, 0.22)``):
    its expected cost ``price / p`` exceeds one reliable call;
  - a premium one-shot provider (price ``B * U(0.55, 0.7)``, success ``U(0.97, 0.995)``)
    that eats most of the budget;
  - bundles (2+ needs outside any dependency): price 55 % of the covered needs' standard
    prices (cheap per need) but success ``U(0.3, 0.45)`` for the whole call.
* **Query-dependent quality**: two standard providers per need (``plus`` and ``standard``),
  priced ``u * U(0.85, 1.15)``. Which one is reliable (``U(0.85, 0.95)``; the other
  ``U(0.3, 0.45)``) depends on the query's entity (its "region": a hash of the domain and the
  entity's first argument value) and on the tool name, the same way in every task; their
  descriptions are identical. A predictor that reads the arguments can learn it; the tool
  name alone cannot tell.
* Distractors and market events (probability ``event_rate``) as in v1.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable

from .domains import DOMAIN_NAMES, DOMAINS, Domain
from .generator import (
    _CHEAP_WORDS,
    _OPENERS,
    _PREMIUM_WORDS,
    _check_int,
    _describe,
    _distractors,
    _events,
    _join,
)
from .world import Need, Task, ToolSpec

__all__ = ["V2_BUDGET", "entity_region", "generate_task_v2", "generate_tasks_v2", "provider_region"]

V2_BUDGET = 50
_NEED_COUNT_WEIGHTS = (0.10, 0.35, 0.35, 0.20)
_MID_WORDS_V2 = ("plus", "standard")


def entity_region(domain: str, entity: dict[str, str]) -> int:
    """The query-side feature that decides which standard provider is reliable (0 or 1)."""
    first = str(next(iter(entity.values()), "")).strip().lower()
    return zlib.crc32(f"{domain}|{first}".encode()) % 2


def provider_region(domain: str, word: str) -> int:
    """The region a standard provider is good at: fixed per tool name across tasks."""
    base = zlib.crc32(domain.encode()) % 2
    return base if word == _MID_WORDS_V2[0] else 1 - base


def _tool(domain: Domain, word: str, need: Need, tier: str, price: int, p: float, sens: float) -> ToolSpec:
    return ToolSpec(
        name=f"{domain.name}_{word}_{domain.action}",
        domain=domain.name,
        covers=frozenset({need.id}),
        tier=tier,  # type: ignore[arg-type]
        price=max(1, int(price)),
        base_success=round(p, 4),
        arg_sensitivity=round(sens, 3),
        description=_describe(tier, domain),
    )


def _providers_v2(rng: random.Random, need: Need, domain: Domain, entity: dict[str, str], unit: float,
                  budget: float) -> list[ToolSpec]:
    region = entity_region(domain.name, entity)
    out = [_tool(domain, rng.choice(_CHEAP_WORDS), need, "cheap", round(unit * rng.uniform(0.25, 0.4)),
                 rng.uniform(0.1, 0.22), rng.uniform(0.5, 1.0))]
    for word in _MID_WORDS_V2:
        good = provider_region(domain.name, word) == region
        p = rng.uniform(0.85, 0.95) if good else rng.uniform(0.3, 0.45)
        out.append(_tool(domain, word, need, "mid", round(unit * rng.uniform(0.85, 1.15)), p, rng.uniform(1.5, 2.5)))
    out.append(_tool(domain, rng.choice(_PREMIUM_WORDS), need, "premium", round(budget * rng.uniform(0.55, 0.7)),
                     rng.uniform(0.97, 0.995), rng.uniform(1.0, 1.5)))
    return out


def _bundle(rng: random.Random, free: list[Need], atomic: list[ToolSpec]) -> list[ToolSpec]:
    # Bundles stay off dependencies: that keeps the clairvoyant bound's set cover exact (see
    # oracle_bound._check_clairvoyant_dependencies) and the trap is the bundle's own failure.
    if len(free) < 2:
        return []
    k = rng.randint(2, min(3, len(free)))
    chosen = sorted(rng.sample(free, k), key=lambda n: n.id)
    std = sum(min(t.price for t in atomic if t.tier == "mid" and n.id in t.covers) for n in chosen)
    doms = [n.domain for n in chosen]
    return [ToolSpec(
        name="_".join(doms) + "_bundle",
        domain="+".join(doms),
        covers=frozenset(n.id for n in chosen),
        tier="composite",
        price=max(1, round(std * 0.55)),
        base_success=round(rng.uniform(0.3, 0.45), 4),
        arg_sensitivity=round(rng.uniform(1.0, 2.0), 3),
        description="Bundle API answering " + " and ".join(doms) + " questions in one call.",
    )]


def _dependencies(rng: random.Random, k: int) -> dict[int, int]:
    """dependent index -> prerequisite index (always an earlier need)."""
    deps: dict[int, int] = {}
    if k >= 2 and rng.random() < 0.6:
        j = rng.randint(1, k - 1)
        deps[j] = rng.randint(0, j - 1)
    if k >= 3 and rng.random() < 0.3:
        rest = [j for j in range(1, k) if j not in deps]
        if rest:
            j = rng.choice(rest)
            deps[j] = rng.randint(0, j - 1)
    return deps


def generate_task_v2(
    task_seed: int,
    *,
    task_id: str,
    budget: float | None = None,
    domains: tuple[str, ...] = DOMAIN_NAMES,
    event_rate: float = 0.0,
    max_needs: int = 4,
    budget_scale: float = 1.0,
) -> Task:
    """One v2 task from its own seed (see the module docstring for the recipe)."""
    rng = random.Random(task_seed)
    b = float(budget) if budget is not None else float(round(V2_BUDGET * budget_scale))
    k_max = min(max_needs, len(domains))
    k = rng.choices(range(1, k_max + 1), weights=_NEED_COUNT_WEIGHTS[:k_max])[0]
    chosen = rng.sample(list(domains), k)
    deps = _dependencies(rng, k)
    needs: list[Need] = []
    entities: list[dict[str, str]] = []
    canonical: dict[str, dict[str, str]] = {}
    phrases: list[str] = []
    for i, name in enumerate(chosen):
        dom = DOMAINS[name]
        entity = dict(rng.choice(dom.entities))
        nid = f"n{i}_{name}"
        desc = dom.render(dom.description, entity)
        phrase = dom.render(dom.phrase, entity)
        requires: tuple[str, ...] = ()
        if i in deps:
            pre = needs[deps[i]]
            requires = (pre.id,)
            desc = f"{desc} (its arguments come from the result of: {pre.description})"
            phrase = f"then, using that result, {phrase}"
        need = Need(nid, name, desc, dom.arg_keys, requires)
        needs.append(need)
        entities.append(entity)
        canonical[nid] = entity
        phrases.append(phrase)
    opener, closer = rng.choice(_OPENERS)
    query = opener + _join(phrases) + closer

    unit = b / (k * rng.uniform(1.05, 1.5))
    atomic: list[ToolSpec] = []
    for need, entity in zip(needs, entities):
        atomic.extend(_providers_v2(rng, need, DOMAINS[need.domain], entity, unit, b))
    involved = {n.id for n in needs if n.requires} | {r for n in needs for r in n.requires}
    tools = atomic + _bundle(rng, [n for n in needs if n.id not in involved], atomic)
    tools += _distractors(rng, chosen, tuple(domains), {t.name for t in tools})
    rng.shuffle(tools)
    events = _events(rng, tools, k) if event_rate > 0 and rng.random() < event_rate else ()
    return Task(task_id=task_id, query=query, needs=tuple(needs), tools=tuple(tools), budget=b,
                canonical_args=canonical, events=events, seed=task_seed)


def generate_tasks_v2(
    n: int,
    seed: int,
    *,
    budget: float | None = None,
    domains: Iterable[str] = DOMAIN_NAMES,
    event_rate: float = 0.0,
    max_needs: int = 4,
    budget_scale: float = 1.0,
) -> list[Task]:
    """``n`` v2 tasks from ``seed`` (same contract as :func:`.generate_tasks`: pure, prefix-stable).

    ``budget`` fixes the budget (prices scale with it); otherwise it is ``50 * budget_scale``.
    """
    from .generator import generate_tasks

    # Reuse v1's argument checks (one wording for every bad input), then generate v2 tasks.
    generate_tasks(1, seed, budget=budget, domains=domains, event_rate=event_rate, max_needs=max_needs,
                   budget_scale=budget_scale)
    n = _check_int(n, "n", 1, "ask for at least one task, e.g. n=200")
    doms = tuple(dict.fromkeys((domains,) if isinstance(domains, str) else domains))
    master = random.Random(seed ^ 0x5EED_0002)  # another stream than v1: v2 task i is not v1 task i
    task_seeds = [master.getrandbits(63) for _ in range(n)]
    return [
        generate_task_v2(s, task_id=f"syn2-{seed}-{i:04d}", budget=budget, domains=doms,
                         event_rate=float(event_rate), max_needs=max_needs, budget_scale=float(budget_scale))
        for i, s in enumerate(task_seeds)
    ]
