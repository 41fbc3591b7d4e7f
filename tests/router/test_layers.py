"""router/'s groups import only downward, and the rest of the tree imports a group by its package.

The order is the design (README's Layout): a group may use those below it and
the shared vocabulary at the bottom, never one above; the request path on top
uses them all. A new import that goes up fails here, not in review.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUTER = ROOT / "router"
# bottom to top; "bottom" and "top" are router/'s own modules
ORDER = ["bottom", "config", "observe", "backend", "queueing", "quotas", "fleet", "admission", "top"]
BOTTOM = {"errors", "error_spec", "ids", "sockets"}
LAZY = {("observe", "tracing")}  # imports the OpenTelemetry SDK: by module, once [tracing] is on


def group(parts: list[str]) -> str:
    """The group of ``router.x[.y]``: a subpackage, or "bottom"/"top" for router/'s own modules."""
    if (ROUTER / parts[1]).is_dir():
        return parts[1]
    return "bottom" if parts[1] in BOTTOM else "top"


def imported(path: Path) -> Iterator[tuple[list[str], int]]:
    """Every router module or package ``path`` imports, as ["router", ...], with its line."""
    package = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            target = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
        elif node.module and node.module.startswith("tailguard.router"):
            target = node.module.split(".")[1:]
        else:
            continue
        if target[:1] != ["router"]:
            continue
        if len(target) == 1:  # from tailguard.router import x: modules by name, or the facade
            for alias in node.names:
                yield (["router", alias.name] if (ROUTER / f"{alias.name}.py").exists() or (ROUTER / alias.name).is_dir() else ["router", "__init__"]), node.lineno
        else:
            yield target, node.lineno


def test_the_groups_import_only_downward() -> None:
    upward = []
    for path in ROUTER.rglob("*.py"):
        rel = list(path.relative_to(ROOT).with_suffix("").parts)
        if rel[-1] == "__init__" and len(rel) == 2:
            continue  # router/__init__ re-exports the facade on top
        me = group(rel if len(rel) > 2 else rel)
        for target, line in imported(path):
            if target[1] == "__init__":
                upward.append(f"{path.relative_to(ROOT)}:{line} imports the facade")
                continue
            them = group(target)
            if ORDER.index(them) > ORDER.index(me):
                upward.append(f"{path.relative_to(ROOT)}:{line} ({me}) imports {'.'.join(target)} ({them})")
    assert upward == []


def test_router_keeps_a_dozen_modules_on_top_and_groups_below() -> None:
    top = [p.name for p in ROUTER.glob("*.py") if p.name != "__init__.py"]
    groups = [p.name for p in ROUTER.iterdir() if (p / "__init__.py").exists()]
    assert len(top) <= 12, top
    assert sorted(groups) == sorted(ORDER[1:-1])


def test_outside_a_group_its_package_is_imported_not_its_modules() -> None:
    """Code outside router/ and other groups import ``tailguard.router.fleet``, not ``.fleet.pool``
    (a private name, or a lazily imported module, is the one reason to reach in)."""
    reaching_in = []
    for folder in ("router", "server", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            if "gen" in path.parts or "results" in path.parts:
                continue
            rel = list(path.relative_to(ROOT).with_suffix("").parts)
            mine = rel[1] if rel[0] == "router" and len(rel) > 2 else None
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for target, line in imported(path):
                if len(target) != 3 or not (ROUTER / target[1]).is_dir() or target[1] == mine or (target[1], target[2]) in LAZY:
                    continue
                node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.lineno == line)
                if all(alias.name.startswith("_") for alias in node.names):
                    continue
                reaching_in.append(f"{path.relative_to(ROOT)}:{line} imports {'.'.join(target)}")
    assert reaching_in == []


def test_the_readme_layout_names_every_module_of_the_core() -> None:
    """README's Layout draws router/'s tree: a module added without a line there fails here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Layout") :]
    missing = [
        str(path.relative_to(ROOT))
        for path in sorted(ROUTER.rglob("*.py"))
        if path.name != "__init__.py" and path.name not in layout
    ]
    assert not missing, f"README's Layout does not name: {missing}"
