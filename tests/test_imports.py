"""The import graph keeps the layering one way: storage -> blend -> eval, with the command
root (blend/cli/) the only place allowed to import across layers upward.

Built from the source with `ast` (imports inside functions count, as do imports under
TYPE_CHECKING), so a lazy import cannot hide a cycle or an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("storage", "blend", "eval")  # lowest first
LAYER = {name: i for i, name in enumerate(PACKAGES)}
COMMAND_ROOT = "blend.cli"
# blend's sub-packages, lowest first: one may import a lower one, never a higher one. Modules at
# blend's root (config, modes, stats) are shared leaves outside the order (cycles still count).
BLEND_ORDER = ("model", "prompt", "kv", "recompute", "planning", "decode", "session", "engine", "server", "vllm",
               "cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """{module: modules of ours it imports}, resolving `from pkg import name` to pkg.name
    when that is a module of ours."""
    modules = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a.b.c where only a.b is a module
                    target = target.rpartition(".")[0]
                if target and target != name and target.split(".")[0] in LAYER:
                    deps.add(target)
        graph[name] = deps
    return graph


def is_command_root(module: str) -> bool:
    return module == COMMAND_ROOT or module.startswith(COMMAND_ROOT + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "storage.stack" in graph["blend.engine.engine"]
    assert any(d.startswith("eval.") for d in graph["blend.cli.eval"])  # lazy imports inside functions count


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_upward_imports_outside_the_command_root():
    upward = []
    for module, deps in import_graph().items():
        if is_command_root(module):
            continue
        for dep in deps:
            if is_command_root(dep) or LAYER[dep.split(".")[0]] > LAYER[module.split(".")[0]]:
                upward.append(f"{module} -> {dep}")
    assert upward == []


def blend_level(module: str) -> int | None:
    """The position of a blend module's sub-package in BLEND_ORDER (None: a root module)."""
    parts = module.split(".")
    if parts[0] != "blend" or len(parts) < 3 and not (len(parts) == 2 and parts[1] in BLEND_ORDER):
        return None
    return BLEND_ORDER.index(parts[1]) if parts[1] in BLEND_ORDER else None


def downward_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, deps in graph.items():
        level = blend_level(module)
        for dep in deps:
            dep_level = blend_level(dep)
            if level is not None and dep_level is not None and dep_level > level:
                found.append(f"{module} -> {dep}")
    return sorted(found)


def test_blend_sub_packages_import_only_lower_ones():
    assert downward_violations(import_graph()) == []


def test_every_blend_sub_package_is_in_the_order():
    packages = {p.parent.name for p in (ROOT / "blend").glob("*/__init__.py")}
    assert packages == set(BLEND_ORDER)


def test_the_checks_can_fail():
    assert downward_violations({"blend.model.runner": {"blend.engine.engine"}, "blend.engine.engine": {"blend.model.runner"}}) \
        == ["blend.model.runner -> blend.engine.engine"]

    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
