"""What the shared-budget stores share: money in integer nano-units, a charge, the store's error,
and the refusal of a hold that does not fit (the package's classes and the SQL stores use them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from intent.errors import IntentError
from intent.ledger import BudgetExceededError
from intent.market import check_amount

__all__ = ["NANO", "ChargeStatus", "StoreCharge", "StoreError", "StoreUnavailableError", "from_nano", "to_nano"]

NANO = 1_000_000_000
ChargeStatus = Literal["reserved", "committed", "released", "expired"]


class StoreError(IntentError, RuntimeError):
    """A shared-budget operation the store cannot do (unknown key, released charge committed...)."""


class StoreUnavailableError(StoreError):
    """The store could not be reached (still failing after its own retries): the operation may succeed later.
    A commit that fails so is kept by the guard and sent again (:class:`intent.stores.CommitOutbox`)."""


def to_nano(amount: float) -> int:
    return int(round(check_amount(amount, "amount") * NANO))


def from_nano(n: int) -> float:
    return n / NANO


@dataclass(frozen=True)
class StoreCharge:
    """One charge against a shared budget."""

    key: str
    charge_id: str
    amount: float
    status: ChargeStatus
    late: bool = False  # committed after its lease had expired
    run_id: str = ""  # the episode (graph thread) that made it
    tool: str = ""  # the tool or model it paid for
    kind: str = "tool"
    lease_until: float = 0.0
    updated_at: float = 0.0


def _no_fit(key: str, charge_id: str, amount: int, budget: int, spent: int, reserved: int) -> BudgetExceededError:
    return BudgetExceededError(
        f"shared budget {key!r}: charge {charge_id!r} of {from_nano(amount):g} does not fit "
        f"(budget {from_nano(budget):g}, spent {from_nano(spent):g}, reserved {from_nano(reserved):g})")
