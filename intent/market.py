"""The tool market: which tools exist, what one call of each costs.

A :class:`Market` is an immutable, versioned snapshot. Every update (a price change,
a new tool, a removal, a ban) returns a *new* snapshot with ``version + 1``; the guard
swaps snapshots between decisions, so an update applies from the next decision on and
never changes the price of a call that was already accepted (its reservation holds the
price it was accepted at).
"""

from __future__ import annotations

from intent.arguments import is_list_arg
from intent.errors import UsageError

import math
import numbers
from decimal import Decimal
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["InvalidPriceError", "Market", "MarketError", "PricedTool", "UnpricedToolError", "check_amount",
           "declared_price", "payment_required"]


class MarketError(UsageError):
    """A market was built or updated with bad input (the user's: a UsageError, so also a ValueError)."""


class InvalidPriceError(MarketError):
    """A price or budget is negative, NaN or infinite."""


class UnpricedToolError(MarketError, KeyError):
    """A tool has no listed price and the market has no ``default_price``."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


def check_amount(value: Any, field_name: str, *, allow_zero: bool = True) -> float:
    """Return ``value`` as a float, or raise naming ``field_name`` and the fix."""
    # int and float first: the ABC check below runs Python code. Decimal is not a numbers.Real but converts.
    if isinstance(value, bool) or not (isinstance(value, (int, float)) or isinstance(value, (numbers.Real, Decimal))):
        raise InvalidPriceError(
            f"{field_name} must be a number, got {type(value).__name__} {value!r}; pass a finite float >= 0"
        )
    try:
        v = float(value)
    except ValueError:  # Decimal("sNaN") will not convert
        raise InvalidPriceError(f"{field_name} is {value!r}; pass a finite number >= 0") from None
    except OverflowError:
        raise InvalidPriceError(f"{field_name} is too large to be a float ({str(value)[:24]}...); pass a finite "
                                "float >= 0") from None
    if math.isnan(v) or math.isinf(v):
        raise InvalidPriceError(f"{field_name} is {v}; pass a finite number >= 0")
    if v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidPriceError(f"{field_name} is {v}; it must be {bound}")
    return v


@dataclass(frozen=True, slots=True)
class PricedTool:
    """One tool on the market and the price of one call.

    ``description`` is optional text that price-aware prompts (the Prompt and BATS
    baselines) may show to the agent.
    """

    name: str
    price: float
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise MarketError(f"PricedTool.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.description, str):
            raise MarketError(f"PricedTool.description of {self.name!r} must be a str, got "
                              f"{type(self.description).__name__} {self.description!r}; pass '' for none")
        object.__setattr__(self, "price", check_amount(self.price, f"price of tool {self.name!r}"))


@dataclass(frozen=True, slots=True)
class Market:
    """An immutable snapshot of the tool market.

    ``Market([PricedTool("get_quote", 12.0), ...], default_price=None)``.

    Banned tools stay listed (their price is still known, e.g. for logs) but
    :meth:`is_available` is false for them and the guard refuses their calls.
    """

    tools: tuple[PricedTool, ...] = ()
    default_price: float | None = None
    banned: frozenset[str] = frozenset()
    version: int = 0
    currency: str | None = None
    _by_name: Mapping[str, PricedTool] = field(default_factory=dict, repr=False, compare=False)

    def __init__(
        self,
        tools: Iterable[PricedTool] = (),
        *,
        default_price: float | None = None,
        banned: Iterable[str] = (),
        version: int = 0,
        currency: str | None = None,
    ) -> None:
        if isinstance(tools, PricedTool):
            raise MarketError(f"Market tools must be a list of PricedTool, got one PricedTool {tools.name!r}; "
                              "write Market([PricedTool(name, price), ...])")
        if not is_list_arg(tools):
            raise MarketError(f"Market tools must be a list of PricedTool, got {type(tools).__name__} {tools!r:.80}; "
                              "write Market([PricedTool(name, price), ...]) or Market.from_prices({name: price})")
        tools = tuple(tools)
        by_name: dict[str, PricedTool] = {}
        for t in tools:
            if not isinstance(t, PricedTool):
                raise MarketError(
                    f"Market tools must be PricedTool instances, got {type(t).__name__}; "
                    "wrap it as PricedTool(name, price)"
                )
            if t.name in by_name:
                raise MarketError(f"duplicate tool name {t.name!r} in the market; each tool must be listed once")
            by_name[t.name] = t
        if default_price is not None:
            default_price = check_amount(default_price, "Market.default_price")
        names = tuple(banned) if is_list_arg(banned, mapping=True) else None
        if names is None or not all(isinstance(b, str) and b for b in names):
            raise MarketError(f"Market.banned must be a list of tool names (str), got {banned!r:.80}; "
                              "write banned=['tool_name'] (or () for none)")
        banned_set = frozenset(names)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise MarketError(f"Market.version must be an int >= 0, got {version!r}")
        object.__setattr__(self, "tools", tools)
        object.__setattr__(self, "default_price", default_price)
        object.__setattr__(self, "banned", banned_set)
        if currency is not None and (not isinstance(currency, str) or not currency.strip()):
            raise MarketError(f"Market.currency must be a currency code like 'USD' or None, got {currency!r}")
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "currency", currency)
        object.__setattr__(self, "_by_name", by_name)

    # ----------------------------------------------------------------- lookups
    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[PricedTool]:
        return iter(self.tools)

    def __len__(self) -> int:
        return len(self.tools)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)

    def get(self, name: str) -> PricedTool | None:
        return self._by_name.get(name)

    def is_available(self, name: str) -> bool:
        return name not in self.banned and (name in self._by_name or self.default_price is not None)

    def price(self, name: str) -> float:
        """The price of one call of ``name``; raises :class:`UnpricedToolError` if unknown."""
        tool = self._by_name.get(name)
        if tool is not None:
            return tool.price
        if self.default_price is not None:
            return self.default_price
        raise UnpricedToolError(
            f"tool {name!r} has no price in the market (version {self.version}); "
            "list it with PricedTool(name, price) or set Market(default_price=...)"
        )

    def prices(self) -> dict[str, float]:
        return {t.name: t.price for t in self.tools if t.name not in self.banned}

    # ----------------------------------------------------------------- updates
    def _next(self, tools: Iterable[PricedTool], banned: Iterable[str] | None = None) -> Market:
        return Market(
            tools,
            default_price=self.default_price,
            banned=self.banned if banned is None else banned,
            version=self.version + 1,
            currency=self.currency,
        )

    def with_price(self, name: str, price: float) -> Market:
        if name not in self._by_name:
            raise MarketError(f"cannot change the price of {name!r}: it is not on the market; use with_tool() to add it")
        return self._next(replace(t, price=price) if t.name == name else t for t in self.tools)

    def with_prices(self, prices: Mapping[str, float]) -> Market:
        unknown = sorted(set(prices) - set(self._by_name))
        if unknown:
            raise MarketError(f"cannot change prices of tools not on the market: {unknown}; add them with with_tool()")
        return self._next(replace(t, price=prices[t.name]) if t.name in prices else t for t in self.tools)

    def with_tool(self, tool: PricedTool) -> Market:
        if not isinstance(tool, PricedTool):
            raise MarketError(f"Market.with_tool needs a PricedTool, got {type(tool).__name__} {tool!r:.80}; "
                              "write market.with_tool(PricedTool(name, price))")
        if tool.name in self._by_name:
            raise MarketError(f"tool {tool.name!r} is already on the market; use with_price() to change its price")
        return self._next((*self.tools, tool))

    def without(self, name: str) -> Market:
        if name not in self._by_name:
            raise MarketError(f"cannot remove {name!r}: it is not on the market")
        return self._next((t for t in self.tools if t.name != name), self.banned - {name})

    def ban(self, name: str) -> Market:
        if name not in self._by_name and self.default_price is None:
            raise MarketError(f"cannot ban {name!r}: it is not on the market")
        return self._next(self.tools, self.banned | {name})

    def unban(self, name: str) -> Market:
        return self._next(self.tools, self.banned - {name})

    # ----------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "currency": self.currency,
            "default_price": self.default_price,
            "banned": sorted(self.banned),
            "tools": [{"name": t.name, "price": t.price, "description": t.description} for t in self.tools],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Market:
        try:
            tools = [PricedTool(d["name"], d["price"], d.get("description", "")) for d in data["tools"]]
        except (KeyError, TypeError) as exc:
            raise MarketError(
                f"market data is malformed ({exc!r}); expected {{'tools': [{{'name', 'price'}}], ...}}"
            ) from exc
        version = data.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int):
            raise MarketError(f"market data's version must be an int >= 0, got {version!r}; write 'version': 0")
        return cls(
            tools,
            default_price=data.get("default_price"),
            banned=data.get("banned", ()),
            version=version,
            currency=data.get("currency"),
        )

    @classmethod
    def from_tools(
        cls, tools: Iterable[Any], *, unpriced: str | float = "refuse", currency: str | None = None,
        prices: Mapping[str, float] | None = None,
    ) -> Market:
        """A market read from the tools' own price declarations (see :func:`declared_price`).

        ``unpriced``: a tool that declares no price is ``"refuse"``d (an error naming it),
        ``"free"`` (price 0) or listed at a default price (a number). ``currency``: the budget's
        currency; a tool declaring another one is an error naming the tool (when ``None``, the
        first declared currency is the market's and all must agree). ``prices`` override.
        """
        if not (unpriced in ("refuse", "free") or (isinstance(unpriced, (int, float)) and not isinstance(unpriced, bool))):
            raise MarketError(f"unpriced must be 'refuse', 'free' or a default price, got {unpriced!r}")
        if not isinstance(unpriced, str):
            unpriced = check_amount(unpriced, "Market.from_tools unpriced (the default price)")
        if not is_list_arg(tools):
            raise MarketError(f"Market.from_tools needs a list of tools, got {type(tools).__name__} {tools!r:.80}; "
                              "pass the agent's tools: Market.from_tools([tool, ...])")
        if prices is not None and not isinstance(prices, Mapping):
            raise MarketError(f"Market.from_tools prices must map tool names to prices, got {type(prices).__name__}; "
                              "write prices={'tool_name': 0.02}")
        listed: list[PricedTool] = []
        market_currency = currency
        for tool in tools:
            name = getattr(tool, "name", None)
            if not isinstance(name, str):
                raise MarketError(f"Market.from_tools needs tools with a name, got {type(tool).__name__}")
            declared = declared_price(tool)
            if prices and name in prices:
                declared = (check_amount(prices[name], f"Market.from_tools prices[{name!r}]"), None)
            if declared is None:
                if unpriced == "refuse":
                    raise UnpricedToolError(
                        f"tool {name!r} declares no price (metadata={{'price': ..., 'currency': ...}}); set its "
                        "metadata, pass prices={...}, or choose unpriced='free' or a default price")
                price = 0.0 if unpriced == "free" else float(unpriced)
            else:
                price, tool_currency = declared
                if tool_currency is not None:
                    if market_currency is None:
                        market_currency = tool_currency
                    elif tool_currency.upper() != market_currency.upper():
                        raise MarketError(
                            f"tool {name!r} is priced in {tool_currency} but the budget is in {market_currency}; "
                            "convert its price or the budget: one budget has one currency")
            listed.append(PricedTool(name, price, str(getattr(tool, "description", "") or "")[:500]))
        return cls(listed, currency=market_currency)

    @classmethod
    def from_prices(cls, prices: Mapping[str, float], **kwargs: Any) -> Market:
        if not isinstance(prices, Mapping):
            raise MarketError(f"Market.from_prices needs a mapping of tool names to prices, got "
                              f"{type(prices).__name__} {prices!r:.80}; write Market.from_prices({{'tool_name': 0.02}})")
        return cls((PricedTool(n, p) for n, p in prices.items()), **kwargs)


def declared_price(tool: Any) -> tuple[float, str | None] | None:
    """The price a tool declares for one call, and its currency, or ``None``.

    Read, in order, from a LangChain tool's ``metadata``: ``{"price": 0.02, "currency": "USD"}``;
    an MCP tool's ``_meta`` or annotations as langchain-mcp-adapters puts them in ``metadata``
    (``metadata["_meta"]["price"]``, ``metadata["annotations"]["price"]``); and an x402-style
    payment requirement (``metadata["x402"]`` or ``metadata["payment_required"]`` with
    ``{"amount" | "maxAmountRequired": ..., "decimals": 6, "asset" | "currency": ...}``, an
    amount in the asset's smallest unit when ``decimals`` is given).
    """
    meta = getattr(tool, "metadata", None)
    if not isinstance(meta, Mapping):
        return None
    for holder in (meta, meta.get("_meta"), meta.get("annotations")):
        if isinstance(holder, Mapping) and holder.get("price") is not None:
            price = check_amount(_number(holder["price"], getattr(tool, "name", "?")),
                                 f"declared price of tool {getattr(tool, 'name', '?')!r}")
            return price, holder.get("currency")
    return _x402_price(meta, getattr(tool, "name", "?"))


def payment_required(artifact: Any, tool: str) -> tuple[float, str | None] | None:
    """The price in a tool's x402-style "payment required" answer (its ToolMessage artifact
    ``{"x402": {"accepts": [{"maxAmountRequired": "30000", "decimals": 6, "asset": "USDC"}]}}``,
    or ``"payment_required"``), or ``None`` for an ordinary answer."""
    # (``artifact`` is usually None: no ABC check for it)
    return _x402_price(artifact, tool) if artifact is not None and isinstance(artifact, Mapping) else None


def _x402_price(holder: Mapping[str, Any], tool: str) -> tuple[float, str | None] | None:
    """An x402-style payment requirement under ``holder["x402"]`` or ``holder["payment_required"]``."""
    for key in ("x402", "payment_required"):
        req = holder.get(key)
        if isinstance(req, Mapping):
            accepts = req.get("accepts")
            if isinstance(accepts, list) and accepts and isinstance(accepts[0], Mapping):
                req = accepts[0]
            raw = req.get("amount", req.get("maxAmountRequired"))
            if raw is None:
                continue
            amount = _number(raw, tool)
            decimals = req.get("decimals")
            if decimals is not None:
                amount = amount / (10 ** int(decimals))
            return check_amount(amount, f"x402 price of tool {tool!r}"), (req.get("currency") or req.get("asset"))
    return None


def _number(value: Any, tool: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise InvalidPriceError(f"tool {tool!r} declares the price {value!r}, which is not a number") from exc
