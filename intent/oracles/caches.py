"""Per-episode memory of the planning oracles (paper, Appendix A.2).

* **Rollout cache** ``C``: the planned future calls kept on acceptance. A proposal that matches
  the head (same tool; arguments tolerant, see :func:`args_match`) is accepted without a new
  simulation and the head is popped; a miss clears the cache.
* **Last-call cache** ``ā``: the last rejected call. Proposing the same call again (``a_t ≈ ā``, the
  same tolerance as the rollout cache's: same tool, arguments per :func:`args_match`, so a repeat that
  retypes an argument's case still counts) is read as the agent insisting; it is accepted if affordable
  and the cache is cleared. The paper's agent
  makes one call per step, so ``ā`` at step t is the call rejected at step t - 1 (none if that one was
  accepted). With parallel calls a turn (model step) can have several calls rejected and accepted, so
  ``ā`` for turn t holds every call rejected in the previous turn that was simulated (not turn t's
  own: a call decided again within its turn, as the gate does on resume after a human denied a top-up,
  is not the agent insisting): the other calls of either turn, whatever their order and outcome, neither
  replace nor clear it, and a hit takes out only that call.
* **Blacklist** ``B``: tools predicted below ``delta``; removed from the visible market for the
  rest of the episode.

Everything is keyed by episode id (one graph thread), so one oracle serves concurrent episodes
without sharing caches. A decision runs :meth:`EpisodeMemory.pinned` to the episode's memory as it
found it: a decision left running by a cancelled run, which finishes after the thread's next run
reset the memory (or after the run ended and it was forgotten), writes into its own run's memory,
not the next run's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from intent.model_protocols import canonical_args

__all__ = ["CachedStep", "EpisodeMemory", "args_match"]


def args_match(a: Mapping[str, Any], b: Mapping[str, Any], *, tolerance: float = 0.5) -> bool:
    """Tolerant argument match: at least ``tolerance`` of the keys of either side agree."""
    keys = set(a) | set(b)
    if not keys:
        return True
    same = sum(1 for k in keys if k in a and k in b and str(a[k]).strip().lower() == str(b[k]).strip().lower())
    return same / len(keys) >= tolerance


@dataclass(frozen=True)
class CachedStep:
    tool: str
    args: dict[str, Any]


@dataclass
class _Episode:
    rollout: list[CachedStep] = field(default_factory=list)
    # The last-call cache: per turn with a simulated decision (latest last, the last two kept), the calls
    # rejected in it, (tool, canonical arguments) -> arguments, in the order they were rejected.
    rejected: list[tuple[int | None, dict[tuple[str, str], Mapping[str, Any]]]] = field(default_factory=list)
    blacklist: set[str] = field(default_factory=set)


# The memory a running decision reads and writes: (the EpisodeMemory, the episode id, its _Episode then).
_PINNED: ContextVar[tuple[Any, str, Any] | None] = ContextVar("intent_pinned_episode_memory", default=None)


class EpisodeMemory:
    """Thread-safe caches and blacklist per episode id."""

    def __init__(self, *, args_tolerance: float = 0.5) -> None:
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self.args_tolerance = args_tolerance

    def _get(self, episode_id: str) -> _Episode:
        pin = _PINNED.get()
        if pin is not None and pin[0] is self and pin[1] == episode_id:
            return pin[2]  # the decision's own run's memory, even if a reset or forget replaced it since
        return self._episodes.setdefault(episode_id, _Episode())

    def reset(self, episode_id: str) -> None:
        with self._lock:
            self._episodes[episode_id] = _Episode()

    def forget(self, episode_id: str) -> None:
        with self._lock:
            self._episodes.pop(episode_id, None)

    def __len__(self) -> int:
        """Episodes held (a finished one is forgotten: memory stays flat over many episodes)."""
        with self._lock:
            return len(self._episodes)

    @contextmanager
    def pinned(self, episode_id: str) -> Iterator[None]:
        """Inside, ``episode_id``'s reads and writes go to its memory as it is now, in this context only."""
        with self._lock:
            ep = self._episodes.setdefault(episode_id, _Episode())
        token = _PINNED.set((self, episode_id, ep))
        try:
            yield
        finally:
            _PINNED.reset(token)

    # ------------------------------------------------------------ rollout cache
    def pop_if_head(self, episode_id: str, tool: str, args: Mapping[str, Any], *, fits: bool = True) -> bool:
        """Hit (the call is the cached plan's next one, and ``fits`` what is left): pop the head and return
        True. Anything else is a miss (the paper's Algorithm 3, lines 8-12): clear the cache and return
        False, so a plan whose next call no longer fits is simulated again, never followed further."""
        with self._lock:
            ep = self._get(episode_id)
            if fits and ep.rollout and ep.rollout[0].tool == tool and args_match(ep.rollout[0].args, args,
                                                                                   tolerance=self.args_tolerance):
                ep.rollout.pop(0)
                return True
            ep.rollout.clear()
            return False

    def set_rollout(self, episode_id: str, steps: list[CachedStep]) -> None:
        with self._lock:
            self._get(episode_id).rollout = list(steps)

    def rollout(self, episode_id: str) -> list[CachedStep]:
        with self._lock:
            return list(self._get(episode_id).rollout)

    # ---------------------------------------------------------- last-call cache
    @staticmethod
    def _held(ep: _Episode, step: int | None) -> list[dict[tuple[str, str], Mapping[str, Any]]]:
        """The rejected calls a proposal of turn ``step`` may repeat: those of the latest earlier simulated
        turn (``step=None``: every held one). Not turn ``step``'s own: the agent insists by proposing a call
        again in a later turn; a call decided again within its turn (the gate run again on resume, after a
        human denied its top-up) is not a new proposal, and must not be let through unsimulated."""
        if step is None:
            return [calls for _, calls in ep.rejected]
        before = [calls for turn, calls in ep.rejected if turn != step]
        return before[-1:]

    def _match(self, calls: dict[tuple[str, str], Mapping[str, Any]], tool: str, args: Mapping[str, Any]
               ) -> tuple[str, str] | None:
        """The held call ``(tool, args)`` repeats: the same one if held, else the first held one of the same
        tool whose arguments match tolerantly (Algorithm 3, line 4: ``a_t ≈ ā``)."""
        key = (tool, canonical_args(args))
        if key in calls:
            return key
        return next((k for k, held in calls.items()
                     if k[0] == tool and args_match(held, args, tolerance=self.args_tolerance)), None)

    def is_last_rejected(self, episode_id: str, tool: str, args: Mapping[str, Any], *,
                         step: int | None = None) -> bool:
        with self._lock:
            return any(self._match(calls, tool, args) is not None
                       for calls in self._held(self._get(episode_id), step))

    def take_last_rejected(self, episode_id: str, tool: str, args: Mapping[str, Any], *,
                           step: int | None = None) -> None:
        """The agent proposed this rejected call again and it was let through: it is no longer held (the
        other calls rejected with it are)."""
        with self._lock:
            for calls in self._held(self._get(episode_id), step):
                key = self._match(calls, tool, args)
                if key is not None:
                    del calls[key]

    def set_last_rejected(self, episode_id: str, tool: str | None, args: Mapping[str, Any] | None = None, *,
                          step: int | None = None) -> None:
        """A simulated decision in turn ``step``: ``tool=None`` an acceptance, otherwise the rejection of
        ``(tool, args)``. Its turn becomes the latest simulated one, so a later turn's proposals repeat
        this turn's rejections only (Algorithm 3, lines 41 and 45, one turn at a time)."""
        with self._lock:
            ep = self._get(episode_id)
            if not ep.rejected or ep.rejected[-1][0] != step or step is None:
                ep.rejected = [*ep.rejected[-1:], (step, {})]
            if tool is not None:
                ep.rejected[-1][1][(tool, canonical_args(args or {}))] = dict(args or {})

    # ----------------------------------------------------------------- blacklist
    def blacklist(self, episode_id: str, tools: set[str] | None = None) -> set[str]:
        with self._lock:
            ep = self._get(episode_id)
            if tools:
                ep.blacklist |= tools
            return set(ep.blacklist)
