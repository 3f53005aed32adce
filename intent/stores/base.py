"""What the shared-budget stores share: money in integer nano-units, a charge, the store's error,
and the refusal of a hold that does not fit (the package's classes and the SQL stores use them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from intent.errors import IntentError, UsageError
from intent.ledger import BudgetExceededError
from intent.market import check_amount

__all__ = ["NANO", "ChargeStatus", "KeptCommitRefusedError", "StoreCharge", "StoreError", "StoreUnavailableError",
           "from_nano", "to_nano"]

NANO = 1_000_000_000
ChargeStatus = Literal["reserved", "committed", "released", "expired"]


class StoreError(IntentError, RuntimeError):
    """A shared-budget operation the store cannot do (unknown key, released charge committed...)."""


class StoreArgumentError(StoreError, UsageError):
    """A wrong argument of :mod:`intent.stores` (a store URL, a period, a key's scope): also a
    :class:`~intent.errors.UsageError`, so a ``ValueError`` too."""


class StoreUnavailableError(StoreError):
    """The store could not be reached (still failing after its own retries): the operation may succeed later.
    A commit that fails so is kept by the guard and sent again (:class:`intent.stores.CommitOutbox`)."""


class KeptCommitRefusedError(StoreError):
    """Commits the guard kept while the store was unreachable (:class:`intent.stores.CommitOutbox`) that the store
    refused when they were sent again (their hold released meanwhile, their budget key gone): dropped from the
    outbox, so they block no later operation, and raised once. ``refused``: ``(key, charge id, amount, the store's
    error)`` for each."""

    def __init__(self, refused: list[tuple[str, str, float | None, StoreError]]) -> None:
        self.refused = refused
        what = "; ".join(f"charge {charge_id!r} on {key!r}" + ("" if amount is None else f" ({amount:g})")
                         + f": {error}" for key, charge_id, amount, error in refused)
        super().__init__(
            f"the budget store refused {len(refused)} kept commit(s) of calls that ran: {what}. They were dropped "
            "from the guard's outbox (guard.store_outbox), so the guard's ledger counts them but the shared budget "
            "does not: check the key's charges (store.charges(key)) and settle them by hand")


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
