"""Model prices: what one model call costs, per input, output and cached-input token.

* :class:`ModelPrice` is one model's price per **million** tokens, in the budget's currency.
* :class:`ModelPrices` is the table the guard reads, by model name. A name the provider
  reports with a suffix (``gpt-4o-mini-2024-07-18``) matches the longest listed prefix
  (``gpt-4o-mini``). Build it from a dict, a JSON file (:meth:`ModelPrices.from_file`) or,
  with the ``prices`` extra, the maintained ``genai-prices`` library
  (:meth:`ModelPrices.from_genai_prices`). The project ships no hand-written price list.

The cost of a response is read from its ``usage_metadata`` (``input_tokens``,
``output_tokens``, ``input_token_details["cache_read"]`` and ``["cache_creation"]``): input tokens read
from a prompt cache are billed at ``cached_input_per_mtok``, input tokens written to it at
``cache_write_per_mtok`` (each the input price when not given), the rest at the input price. A call's
worst case prices its whole prompt at the dearest of these, so a prompt the provider writes to its cache
(Anthropic bills that at 1.25x the input price, 2x for a one-hour cache) never costs more than was
reserved when the write price is given.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from intent.arguments import is_path_arg
from intent.errors import GuardConfigError, UsageError
from intent.market import check_amount

__all__ = ["ModelPrice", "ModelPrices", "UnpricedModelError", "cost_of_usage", "tokens_of"]

_MTOK = 1_000_000.0


class UnpricedModelError(GuardConfigError, KeyError):
    """A model call whose model has no price in the table (and the policy is to refuse)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """A model's price per million tokens: input, output, input read from a prompt cache and input written
    to it (those two default to the input price)."""

    input_per_mtok: float
    output_per_mtok: float
    cached_input_per_mtok: float | None = None
    cache_write_per_mtok: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_per_mtok", check_amount(self.input_per_mtok, "ModelPrice.input_per_mtok"))
        object.__setattr__(self, "output_per_mtok", check_amount(self.output_per_mtok, "ModelPrice.output_per_mtok"))
        for name in ("cached_input_per_mtok", "cache_write_per_mtok"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_amount(getattr(self, name), f"ModelPrice.{name}"))

    def cost(self, input_tokens: int, output_tokens: int, cached_input_tokens: int = 0,
             cache_write_tokens: int = 0) -> float:
        """The cost of one call. ``input_tokens`` includes the tokens read from and written to a prompt cache
        (as LangChain reports them)."""
        total_in = _token_count(input_tokens, "input_tokens")
        output_tokens = _token_count(output_tokens, "output_tokens")
        cached = min(_token_count(cached_input_tokens, "cached_input_tokens"), total_in)
        written = min(_token_count(cache_write_tokens, "cache_write_tokens"), total_in - cached)
        cached_price = self.input_per_mtok if self.cached_input_per_mtok is None else self.cached_input_per_mtok
        write_price = self.input_per_mtok if self.cache_write_per_mtok is None else self.cache_write_per_mtok
        return ((total_in - cached - written) * self.input_per_mtok + cached * cached_price + written * write_price
                + output_tokens * self.output_per_mtok) / _MTOK

    def worst_case(self, prompt_tokens: int, max_output_tokens: int) -> float:
        """The most a call can cost: every allowed output token, and the whole prompt at the dearest input price
        (written to the cache, where that costs more than plain input)."""
        if self.cache_write_per_mtok is not None and self.cache_write_per_mtok > self.input_per_mtok:
            return self.cost(prompt_tokens, max_output_tokens, 0, prompt_tokens)
        return self.cost(prompt_tokens, max_output_tokens, 0)

    def to_dict(self) -> dict[str, float | None]:
        return {"input_per_mtok": self.input_per_mtok, "output_per_mtok": self.output_per_mtok,
                "cached_input_per_mtok": self.cached_input_per_mtok, "cache_write_per_mtok": self.cache_write_per_mtok}


def _token_count(value: Any, name: str) -> int:
    # A negative count would make a negative cost: a model call that gives money back.
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise UsageError(f"ModelPrice.cost: {name} must be a whole number of tokens >= 0, got "
                         f"{type(value).__name__} {value!r}; pass the count the provider reported (usage_metadata)")
    return int(value)


def tokens_of(usage: Mapping[str, Any]) -> dict[str, int]:
    """A LangChain ``usage_metadata`` dict as ``{"input", "output", "cached"}`` token counts, and
    ``"cache_write"`` when the prompt was written to a cache."""
    details = usage.get("input_token_details") or {}
    tokens = {"input": int(usage.get("input_tokens", 0) or 0), "output": int(usage.get("output_tokens", 0) or 0),
              "cached": int(details.get("cache_read", 0) or 0)}
    written = int(details.get("cache_creation", 0) or 0)
    if written:
        tokens["cache_write"] = written
    return tokens


def cost_of_usage(price: ModelPrice, usage: Mapping[str, Any]) -> float:
    """The cost of a LangChain ``usage_metadata`` dict under ``price``."""
    t = tokens_of(usage)
    return price.cost(t["input"], t["output"], t["cached"], t.get("cache_write", 0))


class ModelPrices:
    """Prices by model name: ``ModelPrices({"gpt-4o-mini": ModelPrice(0.15, 0.60, 0.075)})``."""

    def __init__(self, prices: Mapping[str, ModelPrice | Mapping[str, Any]] | None = None, *,
                 currency: str | None = None) -> None:
        if prices is not None and not isinstance(prices, Mapping):
            raise GuardConfigError(
                f"model_prices must map model names to prices, got {type(prices).__name__} {prices!r:.80}; pass "
                "{'gpt-4o-mini': ModelPrice(input_per_mtok=0.15, output_per_mtok=0.6)}")
        if currency is not None and (not isinstance(currency, str) or not currency.strip()):
            raise GuardConfigError(f"ModelPrices currency must be a currency code like 'USD' or None, got {currency!r}")
        table: dict[str, ModelPrice] = {}
        for name, price in (prices or {}).items():
            if not isinstance(name, str) or not name:
                raise GuardConfigError(f"model_prices keys must be model names (non-empty str), got {name!r}")
            if isinstance(price, Mapping):
                try:
                    price = ModelPrice(**price)
                except TypeError as exc:
                    raise GuardConfigError(
                        f"model_prices[{name!r}] = {dict(price)!r} is not a price: give input_per_mtok, "
                        "output_per_mtok and optionally cached_input_per_mtok and cache_write_per_mtok") from exc
            if not isinstance(price, ModelPrice):
                raise GuardConfigError(
                    f"model_prices[{name!r}] must be an intent.ModelPrice, got {type(price).__name__}; "
                    "write ModelPrice(input_per_mtok=..., output_per_mtok=...)")
            table[name] = price
        self._table = table
        self.currency = currency

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        currency = f", currency={self.currency!r}" if self.currency else ""
        return f"ModelPrices({self._table!r}{currency})"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._table)

    def find(self, model: str | None) -> tuple[str, ModelPrice] | None:
        """The entry for ``model``: exact name, else the longest listed prefix (a dated version)."""
        if not model:
            return None
        if model in self._table:
            return model, self._table[model]
        for name in sorted(self._table, key=len, reverse=True):
            if model.startswith(name) and model[len(name):len(name) + 1] in ("-", "@", ":", "."):
                return name, self._table[name]
        return None

    def most_expensive(self) -> ModelPrice | None:
        """The highest price on each axis: the worst case for a model the table does not know."""
        if not self._table:
            return None
        prices = list(self._table.values())
        return ModelPrice(max(p.input_per_mtok for p in prices), max(p.output_per_mtok for p in prices),
                          max(p.input_per_mtok if p.cached_input_per_mtok is None else p.cached_input_per_mtok
                              for p in prices),
                          max(p.input_per_mtok if p.cache_write_per_mtok is None else p.cache_write_per_mtok
                              for p in prices))

    def to_dict(self) -> dict[str, Any]:
        return {"currency": self.currency, "models": {k: v.to_dict() for k, v in self._table.items()}}

    @classmethod
    def of(cls, prices: ModelPrices | Mapping[str, Any] | None) -> ModelPrices:
        return prices if isinstance(prices, ModelPrices) else cls(prices or {})

    @classmethod
    def from_file(cls, path: str | Path) -> ModelPrices:
        """A JSON file: ``{"currency": "USD", "models": {"name": {"input_per_mtok": ..., ...}}}``."""
        if not is_path_arg(path):
            raise GuardConfigError(f"ModelPrices.from_file needs the path of a JSON price file, got {path!r}; "
                                   "write ModelPrices.from_file('prices.json')")
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise GuardConfigError(f"cannot read model prices from {path}: {exc}") from exc
        if not isinstance(data, Mapping) or not isinstance(data.get("models"), Mapping):
            raise GuardConfigError(
                f'{path}: expected {{"currency": "USD", "models": {{"gpt-4o-mini": {{"input_per_mtok": 0.15, '
                '"output_per_mtok": 0.6, "cached_input_per_mtok": 0.075}}}} (prices per million tokens; '
                "ModelPrices(...).to_dict() writes this shape)")
        return cls(data["models"], currency=data.get("currency"))

    @classmethod
    def from_genai_prices(cls, models: Iterable[str], *, provider: str | None = None) -> ModelPrices:
        """Prices of ``models`` (USD) from the ``genai-prices`` package (``pip install intent[prices]``).

        Read from the package's bundled snapshot: nothing is fetched at run time.
        """
        try:
            import genai_prices
        except ImportError as exc:
            raise GuardConfigError(
                "ModelPrices.from_genai_prices needs the genai-prices package: pip install 'intent[prices]'") from exc
        table: dict[str, ModelPrice] = {}
        for model in models:
            def price_of(**usage: int) -> float:
                try:
                    calc = genai_prices.calc_price(genai_prices.Usage(**usage), model, provider_id=provider)
                except LookupError as exc:
                    raise GuardConfigError(f"genai-prices does not know the model {model!r}: {exc}") from exc
                return float(calc.total_price)

            n = int(_MTOK)
            table[model] = ModelPrice(price_of(input_tokens=n), price_of(output_tokens=n),
                                      price_of(input_tokens=n, cache_read_tokens=n),
                                      price_of(input_tokens=n, cache_write_tokens=n))
        return cls(table, currency="USD")
