"""Load StableToolBench's solvable test queries (read-only, from a path outside the repo).

Data path resolution, first match wins:

1. the ``root`` argument (e.g. the CLI's ``--stb-path``);
2. the environment variable ``INTENT_STB_PATH``;
3. ``<repo root>/../shared/stabletoolbench`` (the sibling of the repository).

The root must contain ``solvable_queries/test_instruction/<G>.json`` and
``solvable_queries/test_query_ids/<G>.json``. Nothing is copied into the repository.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from intent.errors import UsageError

from .naming import function_name as _function_name
from .naming import param_name, pure_api_name, standardize

__all__ = [
    "ENV_VAR",
    "GROUPS",
    "Param",
    "StbApi",
    "StbDataError",
    "StbQuery",
    "api_pool",
    "default_root",
    "load_group",
    "load_queries",
    "resolve_root",
]

GROUPS: tuple[str, ...] = (
    "G1_instruction",
    "G1_category",
    "G1_tool",
    "G2_instruction",
    "G2_category",
    "G3_instruction",
)
ENV_VAR = "INTENT_STB_PATH"
_HOW_TO_FIX = f"pass --stb-path or set {ENV_VAR}"

_QUERY_KEYS = ("query", "query_id", "api_list", "relevant APIs")
_API_KEYS = ("category_name", "tool_name", "api_name", "required_parameters", "optional_parameters")
_PARAM_KEYS = ("name", "type")


class StbDataError(UsageError):
    """The StableToolBench data is missing or malformed; the message names the path and the fix."""


@dataclass(frozen=True)
class Param:
    """One API parameter as in the query files (raw name) plus its schema name."""

    name: str
    type: str
    description: str = ""
    default: Any = field(default="", compare=False, hash=False)

    @property
    def schema_name(self) -> str:
        """``change_name(standardize(name))``: the key the agent must use."""
        return param_name(self.name)


@dataclass(frozen=True)
class StbApi:
    """One API of a query's ``api_list``."""

    category: str
    tool_name: str
    api_name: str
    description: str
    required: tuple[Param, ...]
    optional: tuple[Param, ...]
    template_response: Any | None = field(default=None, compare=False, hash=False, repr=False)
    function_name: str = ""

    def __post_init__(self) -> None:
        if not self.function_name:
            object.__setattr__(self, "function_name", _function_name(self.tool_name, self.api_name))

    @property
    def key(self) -> tuple[str, str]:
        """(raw tool name, raw API name): the identity used by ``relevant APIs``."""
        return (self.tool_name, self.api_name)

    @property
    def standard_tool_name(self) -> str:
        return standardize(self.tool_name)

    @property
    def pure_api_name(self) -> str:
        """``change_name(standardize(api_name))``, untruncated (what the client sends the server)."""
        return pure_api_name(self.api_name)


@dataclass(frozen=True)
class StbQuery:
    query_id: int
    group: str
    query: str
    api_list: tuple[StbApi, ...]
    relevant: tuple[tuple[str, str], ...]

    @property
    def relevant_apis(self) -> tuple[StbApi, ...]:
        """The ``api_list`` entries named by ``relevant APIs`` (always a subset upstream)."""
        wanted = set(self.relevant)
        return tuple(a for a in self.api_list if a.key in wanted)

    @property
    def relevant_function_names(self) -> tuple[str, ...]:
        """Function names of the relevant APIs (order of ``relevant``; built with the naming rules)."""
        return tuple(_function_name(t, a) for t, a in self.relevant)


# --------------------------------------------------------------------------- paths


def default_root() -> Path:
    """``<repo root>/../shared/stabletoolbench`` where repo root is three levels above this file."""
    repo_root = Path(__file__).resolve().parents[2]
    return repo_root.parent / "shared" / "stabletoolbench"


def resolve_root(root: str | os.PathLike[str] | None = None) -> Path:
    """Resolve the data root (argument, then ``INTENT_STB_PATH``, then the default) and check it."""
    if root is not None:
        path, source = Path(root), "the given path"
    elif os.environ.get(ENV_VAR):
        path, source = Path(os.environ[ENV_VAR]), f"${ENV_VAR}"
    else:
        path, source = default_root(), "the default location"
    path = path.expanduser()
    if not path.is_dir():
        raise StbDataError(
            f"StableToolBench data not found at {path} ({source}); {_HOW_TO_FIX} to the folder "
            "that holds solvable_queries/"
        )
    if not (path / "solvable_queries" / "test_instruction").is_dir():
        raise StbDataError(
            f"{path} ({source}) has no solvable_queries/test_instruction/ folder; {_HOW_TO_FIX} "
            "to the StableToolBench folder that holds solvable_queries/"
        )
    return path


def _check_groups(groups: Iterable[str] | None) -> tuple[str, ...]:
    if groups is None:
        return GROUPS
    if isinstance(groups, str):
        groups = (groups,)
    out = tuple(groups)
    bad = [g for g in out if g not in GROUPS]
    if bad:
        raise StbDataError(f"--groups: unknown group(s) {bad}; valid groups are: {', '.join(GROUPS)}")
    repeated = sorted({g for g in out if out.count(g) > 1})
    if repeated:
        # A repeated group loaded its queries twice: every query ran twice under one task id (122 episodes
        # for G3's 61 queries), and --tasks N spread over the doubled list picked another subset.
        raise StbDataError(f"--groups names {', '.join(repeated)} more than once; list each group once")
    return out


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise StbDataError(f"missing file {path}; {_HOW_TO_FIX} to a complete StableToolBench folder")
    try:
        with path.open(encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise StbDataError(
            f"malformed JSON in {path}: {exc.msg} at line {exc.lineno} column {exc.colno}; "
            "restore the file from the StableToolBench release"
        ) from exc
    except UnicodeDecodeError as exc:
        raise StbDataError(f"{path} is not UTF-8 text ({exc}); restore the file") from exc


# --------------------------------------------------------------------------- parsing


def _need(obj: Any, key: str, path: Path, where: str) -> Any:
    if not isinstance(obj, dict):
        raise StbDataError(f"{path}: {where} should be a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise StbDataError(f"{path}: {where} is missing key {key!r}; restore the file")
    return obj[key]


def _parse_params(raw: Any, path: Path, where: str) -> tuple[Param, ...]:
    if not isinstance(raw, list):
        raise StbDataError(f"{path}: {where} should be a list, got {type(raw).__name__}")
    out = []
    for j, p in enumerate(raw):
        w = f"{where}[{j}]"
        name = _need(p, "name", path, w)
        ptype = _need(p, "type", path, w)
        desc = p.get("description") or ""
        out.append(Param(name=str(name), type=str(ptype), description=str(desc), default=p.get("default", "")))
    return tuple(out)


def _parse_api(raw: Any, path: Path, where: str) -> StbApi:
    for key in _API_KEYS:
        _need(raw, key, path, where)
    return StbApi(
        category=str(raw["category_name"]),
        tool_name=str(raw["tool_name"]),
        api_name=str(raw["api_name"]),
        description=str(raw.get("api_description") or ""),
        required=_parse_params(raw["required_parameters"], path, f"{where}.required_parameters"),
        optional=_parse_params(raw["optional_parameters"], path, f"{where}.optional_parameters"),
        template_response=raw.get("template_response"),
    )


def _parse_query(raw: Any, group: str, index: int, path: Path) -> StbQuery:
    where = f"query index {index}"
    for key in _QUERY_KEYS:
        _need(raw, key, path, where)
    qid = raw["query_id"]
    if not isinstance(qid, int) or isinstance(qid, bool):
        raise StbDataError(f"{path}: {where} has a non-integer query_id {qid!r}")
    api_raw = raw["api_list"]
    if not isinstance(api_raw, list) or not api_raw:
        raise StbDataError(f"{path}: {where} (query_id {qid}) needs a non-empty list 'api_list'")
    apis = tuple(_parse_api(a, path, f"{where} api_list[{j}]") for j, a in enumerate(api_raw))
    rel_raw = raw["relevant APIs"]
    if not isinstance(rel_raw, list):
        raise StbDataError(f"{path}: {where} (query_id {qid}) 'relevant APIs' should be a list")
    relevant = []
    for j, pair in enumerate(rel_raw):
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise StbDataError(
                f"{path}: {where} (query_id {qid}) 'relevant APIs'[{j}] should be [tool_name, api_name]"
            )
        relevant.append((pair[0], pair[1]))
    return StbQuery(
        query_id=qid, group=group, query=str(raw["query"]), api_list=apis, relevant=tuple(relevant)
    )


def load_group(root: Path, group: str) -> list[StbQuery]:
    """Load one group from an already-resolved root and validate its ids against test_query_ids."""
    qpath = root / "solvable_queries" / "test_instruction" / f"{group}.json"
    ipath = root / "solvable_queries" / "test_query_ids" / f"{group}.json"
    data = _read_json(qpath)
    if not isinstance(data, list):
        raise StbDataError(f"{qpath}: expected a JSON list of queries, got {type(data).__name__}")
    queries = [_parse_query(item, group, i, qpath) for i, item in enumerate(data)]
    ids = _read_json(ipath)
    if not isinstance(ids, dict):
        raise StbDataError(f"{ipath}: expected a JSON object {{\"<query_id>\": 0}}, got {type(ids).__name__}")
    expected = set(ids)
    got = [str(q.query_id) for q in queries]
    dupes = sorted({g for g in got if got.count(g) > 1})
    if dupes:
        raise StbDataError(f"{qpath}: duplicate query_id(s) {dupes[:10]}")
    missing, extra = sorted(expected - set(got)), sorted(set(got) - expected)
    if missing or extra:
        raise StbDataError(
            f"{qpath} does not match {ipath}: ids only in test_query_ids {missing[:10]}, "
            f"ids only in test_instruction {extra[:10]}; restore both files from the same release"
        )
    return queries


def load_queries(
    root: str | os.PathLike[str] | None = None, groups: Sequence[str] | str | None = None
) -> list[StbQuery]:
    """Load the solvable test queries of ``groups`` (default: all six, in :data:`GROUPS` order)."""
    chosen = _check_groups(groups)
    base = resolve_root(root)
    out: list[StbQuery] = []
    for g in chosen:
        out.extend(load_group(base, g))
    return out


def api_pool(queries: Iterable[StbQuery]) -> list[StbApi]:
    """Distinct APIs by (tool_name, api_name), first occurrence wins (2479 over all 765 queries)."""
    seen: dict[tuple[str, str], StbApi] = {}
    for q in queries:
        for a in q.api_list:
            seen.setdefault(a.key, a)
    return list(seen.values())
