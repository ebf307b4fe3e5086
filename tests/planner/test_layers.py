"""The planner sits below the rest (docs/design.md §2): it imports no study, CLI, engine or runtime
module, and no module of it imports torch or DeepSpeed when it is loaded."""

from __future__ import annotations

import ast
from pathlib import Path

import ds_recycle.planner

PLANNER = Path(ds_recycle.planner.__file__).parent
ABOVE = (
    "ds_recycle.sim",
    "ds_recycle.cli",
    "ds_recycle.engine",
    "ds_recycle.runtime",
    "ds_recycle.integrations",
)
HEAVY = ("torch", "deepspeed")


def _imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import statement of ``tree``."""
    top = {id(node) for node in getattr(tree, "body", [])}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module, id(node) in top))
    return out


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_planner_imports_nothing_above_it() -> None:
    offending = [
        f"{path.name}: {name}"
        for path in sorted(PLANNER.glob("*.py"))
        for name, _ in _imports(ast.parse(path.read_text()))
        if _matches(name, ABOVE)
    ]
    assert offending == []


def test_no_planner_module_loads_torch_or_deepspeed_at_import() -> None:
    offending = [
        f"{path.name}: {name}"
        for path in sorted(PLANNER.glob("*.py"))
        for name, top_level in _imports(ast.parse(path.read_text()))
        if top_level and _matches(name, HEAVY)
    ]
    assert offending == []


def test_the_lowering_emits_plain_actions_without_deepspeed() -> None:
    """Not even inside a function: the engine runs the actions themselves as its instructions."""
    offending = [
        f"{path.name}: {name}"
        for path in sorted(PLANNER.glob("*.py"))
        for name, _ in _imports(ast.parse(path.read_text()))
        if _matches(name, ("deepspeed",))
    ]
    assert offending == []
