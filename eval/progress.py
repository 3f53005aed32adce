"""Re-export: the progress reporter lives in :mod:`intent.progress` (training uses it too)."""

from intent.progress import LINE_EVERY_S, Progress, progress

__all__ = ["LINE_EVERY_S", "Progress", "progress"]
