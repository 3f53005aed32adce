"""Which code made a run's results, for its run directory (:func:`eval.runner._check_config`).

A run directory resumes: the episodes it holds are kept, and only the missing ones run. Episodes made by
other code would then be mixed into one table without a word (a fix to an oracle, re-run into the same
``--out``, reported the old episodes as new). So the directory records the code that wrote it and refuses
other code unless told (``--allow-code-change``).

The code is the git commit of the checkout (with a digest of its uncommitted changes to the Python sources,
tracked and untracked), or the installed package's version when it is not a git checkout.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The packages whose code shapes a result (tests, docs and run directories do not).
SOURCES = ("intent", "eval", "baselines", "worldmodel", "training", "intent_vllm")


def _git(*args: str) -> bytes | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):  # no git here, or it hung: not a checkout we can read
        return None
    return done.stdout if done.returncode == 0 else None


def _checkout() -> bool:
    """Whether ROOT is the top of a git checkout (an installed package inside someone else's repository, a venv
    kept in a project, is not: that repository's commit says nothing of this code)."""
    top = _git("rev-parse", "--show-toplevel")
    return top is not None and Path(top.decode().strip()).resolve() == ROOT.resolve()


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``<commit>`` for a clean checkout, ``<commit>+<digest of the changes>`` for one with uncommitted changes to
    its sources, ``intent <version>`` for an installed package, ``unknown`` when neither can be read."""
    head = _git("rev-parse", "--short=12", "HEAD") if _checkout() else None
    if head:
        changed = hashlib.sha256()
        diff = _git("diff", "HEAD", "--", *SOURCES) or b""
        changed.update(diff)
        # -z: names as they are (not split at a space, not quoted when they are not ASCII)
        untracked = [n for n in (_git("ls-files", "-z", "--others", "--exclude-standard", "--", *SOURCES)
                                 or b"").split(b"\0") if n.endswith(b".py")]
        for name in sorted(untracked):
            try:
                changed.update(name + b"\0" + (ROOT / os.fsdecode(name)).read_bytes())
            except FileNotFoundError:  # removed since git listed it
                changed.update(name + b"\0")
        commit = head.decode().strip()
        return f"{commit}+{changed.hexdigest()[:8]}" if diff or untracked else commit
    try:
        return f"intent {metadata.version('intent')}"
    except metadata.PackageNotFoundError:
        return "unknown"
