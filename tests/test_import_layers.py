"""The packages' layers: every import points down, and no two packages import each other.

Allowed order (a package imports only packages of a lower layer; two packages of one layer import neither
each other)::

    eval                                   the benchmark harness and its `intent bench|compare|...` commands
    training                               trainers and `intent train|serve` (uses baselines' MiniLM weights)
    baselines                              the baseline oracles, embeddings
    worldmodel                             world models and predictors (re-exports intent.model_protocols)
    intent        intent_vllm              the guard library; the vLLM tool-call parser plugin (imports
                                           no project package: it runs inside vLLM's own environment)

Every import counts: module-level and function-local ``import``/``from ... import``, ``TYPE_CHECKING``
blocks, and ``importlib.import_module(...)`` / ``__import__(...)`` of a string literal (or of a loop
variable over a tuple of string literals). Subcommands reach ``intent``'s CLI through the entry-point
group ``intent.commands`` (pyproject.toml), never by an import in ``intent``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYER = {"intent": 0, "intent_vllm": 0, "worldmodel": 1, "baselines": 2, "training": 3, "eval": 4}


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _string_choices(tree: ast.AST) -> dict[str, set[str]]:
    """``for NAME in ("a", "b"):`` loops: NAME -> {"a", "b"} (to resolve ``import_module(NAME)``)."""
    choices: dict[str, set[str]] = defaultdict(set)
    for node in ast.walk(tree):
        if (isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name)
                and isinstance(node.iter, (ast.Tuple, ast.List, ast.Set))):
            choices[node.target.id] |= {e.value for e in node.iter.elts
                                        if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return choices


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, wherever it is in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    choices = _string_choices(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
        elif (isinstance(node, ast.Call) and _called_name(node.func) in ("import_module", "__import__")
              and node.args):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value))
            elif isinstance(arg, ast.Name):
                found += [(node.lineno, name) for name in sorted(choices.get(arg.id, ()))]
    return found


def package_imports() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> where ("file:line module"), for distinct project packages."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for package in LAYER:
        for path in sorted((REPO / package).rglob("*.py")):
            for line, module in imports_of(path):
                target = module.split(".")[0]
                if target in LAYER and target != package:
                    edges[package, target].append(f"{path.relative_to(REPO)}:{line} {module}")
    return edges


def test_every_package_is_in_the_layer_table():
    on_disk = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert on_disk - {"tests", "examples", "scripts"} == set(LAYER), "add the new package to LAYER"


def test_imports_point_down_the_layers():
    upward = [f"{src} (layer {LAYER[src]}) imports {dst} (layer {LAYER[dst]}): {where}"
              for (src, dst), wheres in sorted(package_imports().items()) if LAYER[dst] >= LAYER[src]
              for where in wheres]
    assert not upward, "imports pointing up or sideways:\n" + "\n".join(upward)


def test_no_package_level_cycle():
    edges = package_imports()
    reach: dict[str, set[str]] = {p: {dst for src, dst in edges if src == p} for p in LAYER}
    for _ in LAYER:  # transitive closure (a handful of packages)
        for p in LAYER:
            reach[p] |= {far for near in reach[p] for far in reach[near]}
    cyclic = sorted({tuple(sorted(q for q in LAYER if q == p or (q in reach[p] and p in reach[q])))
                     for p in LAYER if p in reach[p]})
    assert not cyclic, "packages importing each other (directly or through others):\n" + "\n".join(
        f"{', '.join(group)}: " + "; ".join(f"{s} -> {d} ({edges[s, d][0]})" for s, d in sorted(edges)
                                         if s in group and d in group) for group in cyclic)


def test_no_module_cycle_above_intent():
    """No two modules of worldmodel, baselines, training, eval or intent_vllm import each other, directly or
    through others, even inside functions (eval.stb_market and eval.stabletoolbench.solvability did). intent's
    own modules: tests/test_bench_validity.py."""
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
               for package in LAYER if package != "intent" for p in (REPO / package).rglob("*.py")}

    def resolve(name: str) -> str | None:  # `from eval.x import f` is eval.x; `from eval.x import y` may be eval.x.y
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {resolve(name) for _, name in imports_of(path)}
        targets |= {f"{n.module}.{a.name}" for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.ImportFrom) and n.module and not n.level for a in n.names} & modules.keys()
        edges[module] = {m for m in targets if m and m != module}
    cycles = []
    for start in sorted(edges):
        stack, seen = [(start, [start])], set()
        while stack and len(cycles) < 5:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, "module cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("source, expected", [
    ("import eval.cli", "eval.cli"),
    ("def f():\n    from worldmodel.protocols import predict_many", "worldmodel.protocols"),
    ("import importlib\nimportlib.import_module('training.cli')", "training.cli"),
    ("import importlib\nfor m in ('eval.cli', 'x'):\n    importlib.import_module(m)", "eval.cli"),
    ("__import__('eval')", "eval"),
])
def test_the_scan_sees_every_kind_of_import(tmp_path, monkeypatch, source, expected):
    path = REPO / "intent" / "_layer_probe.py"  # a path inside the package, never written
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert expected in [m for _, m in imports_of(path)]


def test_relative_imports_resolve_inside_their_package():
    path = REPO / "eval" / "stabletoolbench" / "environment.py"
    assert "eval.stabletoolbench.loader" in [m for _, m in imports_of(path)]
