"""What a budget is: a total in one currency, with optional sub-caps per kind of spending.

``Budget(total=1.00, tools=0.80, llm=0.30, currency="USD")``: tools and the agent's model
calls share the total; a tool run must also fit ``tools``, a model call (the agent's, or the
oracle's own with ``charge_oracle=True``) must also fit ``llm``. A plain float is a
``Budget(total=x)`` with no sub-caps, in the market's currency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from intent.errors import UsageError
from intent.market import check_amount

__all__ = ["CAP_OF_KIND", "ENTRY_KINDS", "Budget", "EntryKind"]

EntryKind = Literal["tool", "model", "oracle", "sub_agent"]
ENTRY_KINDS: tuple[str, ...] = ("tool", "model", "oracle", "sub_agent")
# Which sub-cap each kind of spending counts against. A sub-agent's carve counts against the
# total only: the sub-agent's own ledger applies the caps to what it spends inside.
CAP_OF_KIND: dict[str, str] = {"tool": "tools", "model": "llm", "oracle": "llm"}


@dataclass(frozen=True, slots=True)
class Budget:
    """A money budget: ``total``, optional ``tools`` / ``llm`` sub-caps, one ``currency``."""

    total: float
    tools: float | None = None
    llm: float | None = None
    currency: str | None = None  # None: whatever currency the market and the price table use

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", check_amount(self.total, "Budget.total"))
        for name in ("tools", "llm"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_amount(value, f"Budget.{name}"))
        if self.currency is not None and (not isinstance(self.currency, str) or not self.currency.strip()):
            raise UsageError(f"Budget.currency must be a currency code like 'USD', got {self.currency!r}")

    def caps(self) -> dict[str, float]:
        return {k: v for k, v in (("tools", self.tools), ("llm", self.llm)) if v is not None}

    @classmethod
    def of(cls, budget: float | Budget) -> Budget:
        return budget if isinstance(budget, Budget) else cls(float(check_amount(budget, "budget")))
