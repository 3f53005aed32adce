"""Bad input to the public API gets an IntentError that names the input and the fix.

Each case was a raw TypeError / AttributeError / ValueError from deep inside, or a nonsense value
silently accepted (a banned="name" string split into letters, NaN sub-caps, gamma=inf...).
"""

from __future__ import annotations

import asyncio
import math

import pytest

from intent import AcceptAll, Budget, BudgetGuard, FromParent, Market, PricedTool, guard_react_agent
from intent.errors import GuardConfigError, IntentError, UsageError
from intent.logs import JsonlLogSink, read_log
from intent.market import MarketError
from intent.policy import AgentPolicy
from intent.pricing import ModelPrice, ModelPrices
from intent.ledger import BudgetLedger, LedgerError
from intent.report import budget_report

NAN, INF = math.nan, math.inf


class _Model:
    def invoke(self, messages, config=None):
        return None

    def bind_tools(self, tools):
        return self


class _WM:
    def simulate(self, tool, args, *, satisfied=None, temperature=None):
        return "{}"


class _Pred:
    def predict(self, reasoning, tool, args):
        return 0.5


class _Untyped:
    name = "t"
    metadata: dict = {}


def _market() -> Market:
    return Market([PricedTool("a", 1.0)])


def _guard(**kwargs) -> BudgetGuard:
    return BudgetGuard(AcceptAll(), _market(), 10.0, **kwargs)


def _priced_guard() -> BudgetGuard:
    return _guard(model_prices={"m": ModelPrice(1.0, 1.0)})


def _intent(**kwargs):
    from intent.oracles import IntentOracle

    return IntentOracle(AgentPolicy(_Model()), _WM(), _Pred(), **kwargs)


def _mco(**kwargs):
    from intent.oracles import MCOOracle

    return MCOOracle(AgentPolicy(_Model()), _WM(), **kwargs)


def _oracles(*args, kind="intent", **kwargs):
    from intent.oracles import IntentOracle, MCOOracle

    return IntentOracle(*args, **kwargs) if kind == "intent" else MCOOracle(*args, **kwargs)


# (id, call, expected exception, text the message must contain: the field)
CASES = [
    # --- Market / PricedTool
    ("PricedTool.description None", lambda: PricedTool("a", 1.0, None), MarketError, "description"),
    ("PricedTool.description int", lambda: PricedTool("a", 1.0, 5), MarketError, "description"),
    ("Market(None)", lambda: Market(None), MarketError, "Market tools"),
    ("Market(5)", lambda: Market(5), MarketError, "Market tools"),
    ("Market(PricedTool)", lambda: Market(PricedTool("a", 1.0)), MarketError, "Market tools"),
    ("Market(banned='abc')", lambda: Market([PricedTool("abc", 1.0)], banned="abc"), MarketError, "banned"),
    ("Market(banned=[3])", lambda: Market([PricedTool("abc", 1.0)], banned=[3]), MarketError, "banned"),
    ("Market(banned=None)", lambda: Market([PricedTool("abc", 1.0)], banned=None), MarketError, "banned"),
    ("Market.with_tool(str)", lambda: _market().with_tool("b"), MarketError, "with_tool"),
    ("Market.from_prices(list)", lambda: Market.from_prices([("a", 1.0)]), MarketError, "from_prices"),
    ("Market.from_dict version", lambda: Market.from_dict({"tools": [], "version": "x"}), MarketError, "version"),
    ("Market.from_tools(None)", lambda: Market.from_tools(None), MarketError, "from_tools"),
    ("Market.from_tools unpriced nan", lambda: Market.from_tools([], unpriced=NAN), MarketError, "unpriced"),
    ("Market.from_tools unpriced -1", lambda: Market.from_tools([_Untyped()], unpriced=-1.0), MarketError,
     "unpriced"),
    ("Market.from_tools prices str", lambda: Market.from_tools([_Untyped()], prices={"t": "x"}), MarketError,
     "prices"),
    # --- FromParent sub-caps
    ("FromParent tools nan", lambda: FromParent(5.0, tools=NAN), MarketError, "FromParent.tools"),
    ("FromParent tools -1", lambda: FromParent(5.0, tools=-1.0), MarketError, "FromParent.tools"),
    ("FromParent llm str", lambda: FromParent(5.0, llm="x"), MarketError, "FromParent.llm"),
    # --- ModelPrices
    ("ModelPrices(list)", lambda: ModelPrices([("m", ModelPrice(1, 1))]), GuardConfigError, "model_prices"),
    ("ModelPrices(str)", lambda: ModelPrices("gpt"), GuardConfigError, "model_prices"),
    ("ModelPrices currency int", lambda: ModelPrices({}, currency=5), GuardConfigError, "currency"),
    ("ModelPrices currency ''", lambda: ModelPrices({}, currency=""), GuardConfigError, "currency"),
    ("ModelPrices.from_file(None)", lambda: ModelPrices.from_file(None), GuardConfigError, "from_file"),
    # --- BudgetGuard constructor
    ("BudgetGuard oracle_model int", lambda: _guard(oracle_model=5), GuardConfigError, "oracle_model"),
    ("BudgetGuard oracle_model ''", lambda: _guard(oracle_model=""), GuardConfigError, "oracle_model"),
    ("BudgetGuard clock None", lambda: _guard(clock=None), GuardConfigError, "clock"),
    ("BudgetGuard clock int", lambda: _guard(clock=5), GuardConfigError, "clock"),
    # --- BudgetGuard methods
    ("top_up graph int", lambda: _guard().top_up("t", 5.0, graph=5), GuardConfigError, "graph"),
    ("atop_up graph int", lambda: asyncio.run(_guard().atop_up("t", 5.0, graph=5)), GuardConfigError, "graph"),
    ("top_up reason int", lambda: _guard().top_up("t", 5.0, reason=5), GuardConfigError, "reason"),
    ("top_up approved_by None", lambda: _guard().top_up("t", 5.0, approved_by=None), GuardConfigError,
     "approved_by"),
    ("ledger(None)", lambda: _guard().ledger(None), GuardConfigError, "ledger"),
    ("ledger(5)", lambda: _guard().ledger(5), GuardConfigError, "ledger"),
    ("ledger(str)", lambda: _guard().ledger("t1"), GuardConfigError, "ledger"),
    ("ledger(list)", lambda: _guard().ledger([]), GuardConfigError, "ledger"),
    ("update_market(None)", lambda: _guard().update_market(None), GuardConfigError, "update_market"),
    ("update_market(dict)", lambda: _guard().update_market({"a": 1.0}), GuardConfigError, "update_market"),
    ("update_market(fn -> None)", lambda: _guard().update_market(lambda m: None), GuardConfigError,
     "update_market"),
    ("update_episode_market(dict)", lambda: _guard().update_episode_market("e", {"a": 1.0}, create=True),
     GuardConfigError, "update_episode_market"),
    ("update_episode_market id int", lambda: _guard().update_episode_market(5, _market(), create=True),
     GuardConfigError, "episode_id"),
    ("metered_model(None)", lambda: _priced_guard().metered_model(None), GuardConfigError, "metered_model"),
    ("metered_model(int)", lambda: _priced_guard().metered_model(5), GuardConfigError, "metered_model"),
    ("metered_model(unknown str)", lambda: _priced_guard().metered_model("nonsense"), GuardConfigError,
     "metered_model"),
    ("tool_node(None)", lambda: _guard().tool_node(None), GuardConfigError, "tool_node"),
    ("tool_node(str)", lambda: _guard().tool_node("abc"), GuardConfigError, "tool_node"),
    # --- guard_react_agent
    ("guard_react_agent model None", lambda: guard_react_agent(None, [], market=_market(), budget=5.0),
     GuardConfigError, "model"),
    ("guard_react_agent tools None", lambda: guard_react_agent(_Model(), None, market=_market(), budget=5.0),
     GuardConfigError, "tools"),
    ("guard_react_agent tools str", lambda: guard_react_agent(_Model(), "abc", market=_market(), budget=5.0),
     GuardConfigError, "tools"),
    ("guard_react_agent guard int", lambda: guard_react_agent(_Model(), [], guard=5), GuardConfigError, "guard"),
    # --- log sinks
    ("JsonlLogSink(None)", lambda: JsonlLogSink(None), UsageError, "JsonlLogSink"),
    ("JsonlLogSink(int)", lambda: JsonlLogSink(5), UsageError, "JsonlLogSink"),
    ("JsonlLogSink('')", lambda: JsonlLogSink(""), UsageError, "JsonlLogSink"),
    ("JsonlLogSink(dir)", lambda: JsonlLogSink("/"), UsageError, "JsonlLogSink"),
    ("JsonlLogSink fsync str", lambda: JsonlLogSink("/tmp/intent-bad-input.jsonl", fsync="no"), UsageError,
     "fsync"),
    ("read_log(None)", lambda: list(read_log(None)), IntentError, "log"),
    # --- oracles
    ("AgentPolicy(None)", lambda: AgentPolicy(None), GuardConfigError, "AgentPolicy"),
    ("AgentPolicy tools None", lambda: AgentPolicy(_Model(), None), GuardConfigError, "tools"),
    ("IntentOracle policy None", lambda: _oracles(None, _WM(), _Pred()), UsageError, "policy"),
    ("IntentOracle generator None", lambda: _oracles(AgentPolicy(_Model()), None, _Pred()), UsageError,
     "generator"),
    ("IntentOracle predictor None", lambda: _oracles(AgentPolicy(_Model()), _WM(), None), UsageError, "predictor"),
    ("IntentOracle gamma inf", lambda: _intent(gamma=INF), UsageError, "gamma"),
    ("IntentOracle gamma str", lambda: _intent(gamma="0.5"), UsageError, "gamma"),
    ("IntentOracle gamma None", lambda: _intent(gamma=None), UsageError, "gamma"),
    ("IntentOracle gamma True", lambda: _intent(gamma=True), UsageError, "gamma"),
    ("IntentOracle delta str", lambda: _intent(delta="0.1"), UsageError, "delta"),
    ("IntentOracle delta None", lambda: _intent(delta=None), UsageError, "delta"),
    ("IntentOracle max_depth 1.5", lambda: _intent(max_depth=1.5), UsageError, "max_depth"),
    ("IntentOracle max_depth str", lambda: _intent(max_depth="8"), UsageError, "max_depth"),
    ("IntentOracle max_depth None", lambda: _intent(max_depth=None), UsageError, "max_depth"),
    ("IntentOracle max_depth inf", lambda: _intent(max_depth=INF), UsageError, "max_depth"),
    ("IntentOracle max_depth True", lambda: _intent(max_depth=True), UsageError, "max_depth"),
    ("IntentOracle alternatives 1.5", lambda: _intent(alternatives=1.5), UsageError, "alternatives"),
    ("IntentOracle alternatives None", lambda: _intent(alternatives=None), UsageError, "alternatives"),
    ("IntentOracle rollout_cache str", lambda: _intent(rollout_cache="no"), UsageError, "rollout_cache"),
    ("IntentOracle blacklist str", lambda: _intent(blacklist="no"), UsageError, "blacklist"),
    ("IntentOracle stochastic str", lambda: _intent(stochastic="no"), UsageError, "stochastic"),
    ("IntentOracle lookahead str", lambda: _intent(lookahead="no"), UsageError, "lookahead"),
    ("IntentOracle show_market str", lambda: _intent(show_market="no"), UsageError, "show_market"),
    ("IntentOracle merge_identical_calls str", lambda: _intent(merge_identical_calls="no"), UsageError,
     "merge_identical_calls"),
    ("MCOOracle policy None", lambda: _oracles(None, _WM(), kind="mco"), UsageError, "policy"),
    ("MCOOracle world_model None", lambda: _oracles(AgentPolicy(_Model()), None, kind="mco"), UsageError,
     "world_model"),
    ("MCOOracle temperature inf", lambda: _mco(temperature=INF), UsageError, "temperature"),
    ("MCOOracle temperature str", lambda: _mco(temperature="hot"), UsageError, "temperature"),
    ("MCOOracle max_depth 2.5", lambda: _mco(max_depth=2.5), UsageError, "max_depth"),
    ("MCOOracle max_depth None", lambda: _mco(max_depth=None), UsageError, "max_depth"),
    ("MCOOracle rollout_cache str", lambda: _mco(rollout_cache="no"), UsageError, "rollout_cache"),
    # --- ModelPrice.cost: a negative count made a negative cost (a model call that gave money back)
    ("ModelPrice.cost input -5", lambda: ModelPrice(1, 1).cost(-5_000_000, 1), UsageError, "input_tokens"),
    ("ModelPrice.cost output -1", lambda: ModelPrice(1, 1).cost(1, -1), UsageError, "output_tokens"),
    ("ModelPrice.cost cached -1", lambda: ModelPrice(1, 1).cost(5, 1, -1), UsageError, "cached_input_tokens"),
    ("ModelPrice.cost input str", lambda: ModelPrice(1, 1).cost("x", 1), UsageError, "input_tokens"),
    ("ModelPrice.cost output 1.5", lambda: ModelPrice(1, 1).cost(1, 1.5), UsageError, "output_tokens"),
    # --- BudgetLedger.from_state: a checkpoint from before the first model step has no ledger (AttributeError)
    ("BudgetLedger.from_state(None)", lambda: BudgetLedger.from_state(None), LedgerError, "intent_ledger"),
    # --- budget_report
    ("budget_report(123)", lambda: budget_report(123), UsageError, "budget_report"),
    ("budget_report([1])", lambda: budget_report([1]), UsageError, "StepRecord"),
]


@pytest.mark.parametrize(("call", "error", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_field(call, error, field):
    with pytest.raises(error) as caught:
        call()
    assert isinstance(caught.value, IntentError)
    assert field in str(caught.value), str(caught.value)


def test_valid_input_still_works():
    """The checks refuse nonsense only: the documented forms keep working."""
    market = Market([PricedTool("a", 1.0, "desc"), PricedTool("b", 2.0)], banned=["b"], currency="USD")
    assert market.banned == frozenset({"b"}) and Market.from_prices({"a": 1}).price("a") == 1.0
    assert Market.from_dict(market.to_dict()) == market
    assert Market.from_tools([_Untyped()], unpriced=0.5).price("t") == 0.5
    assert FromParent(5.0, tools=1.0, llm=2).caps() == {"tools": 1.0, "llm": 2.0}
    assert len(ModelPrices({"m": ModelPrice(1, 2)}, currency="USD")) == 1
    assert ModelPrice(1_000_000, 2_000_000).cost(3, 4) == 11.0 and ModelPrice(1, 1).cost(0, 0) == 0.0
    guard = BudgetGuard(AcceptAll(), market, Budget(5.0), oracle_model="m", clock=lambda: 0.0)
    assert guard.ledger({}).budget == 5.0
    assert guard.update_market(lambda m: m.with_price("a", 3.0)).price("a") == 3.0
    assert guard.update_episode_market("e", market, create=True) is market
    _intent(gamma=5.0, delta=0.0, max_depth=3, alternatives=2, stochastic=True)
    _mco(temperature=None, max_depth=1)
    _mco(temperature=0)
    _oracles(lambda ctx: AgentPolicy(_Model()), _WM(), kind="mco")


def test_model_prices_print_their_table():
    # It printed as <intent.pricing.ModelPrices object at 0x...>.
    shown = repr(ModelPrices({"m": ModelPrice(1, 2)}, currency="USD"))
    assert shown.startswith("ModelPrices({'m': ModelPrice(input_per_mtok=1.0, output_per_mtok=2.0") and "'USD'" in shown
