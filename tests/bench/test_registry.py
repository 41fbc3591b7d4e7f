"""``python -m bench``: one registry, a driver per folder under its folder's name, and no driver importing another."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench.__main__ import DRIVERS, main

BENCH = Path(__file__).resolve().parents[2] / "bench"
SHARED = {"harness", "sim", "advise", "tools", "vllm"}  # what drivers may import besides themselves and the product (vllm: the real engine and its model)


def test_the_registry_lists_every_folder_with_a_run_module_and_nothing_else() -> None:
    assert set(DRIVERS) == {path.parent.name for path in BENCH.glob("*/run.py")}


@pytest.mark.parametrize("name", sorted(DRIVERS))
def test_each_driver_answers_help_under_its_folder_name(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main([name, "--help"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench {name} ")


def test_an_unknown_name_lists_the_drivers_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-driver"]) == 2
    assert "python -m bench health " in capsys.readouterr().out
    assert main([]) == 0


def _bench_imports(path: Path) -> set[str]:
    """The ``bench.X`` packages a module imports, lazily or not."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        found |= {name.split(".")[1] for name in names if name.startswith("bench.")}
    return found


def test_no_driver_imports_another() -> None:
    crossing = {
        f"{path.relative_to(BENCH)} -> bench.{other}"
        for path in BENCH.glob("*/**/*.py")
        if path.relative_to(BENCH).parts[0] not in SHARED
        for other in _bench_imports(path) - SHARED - {path.relative_to(BENCH).parts[0], "__main__"}
    }
    assert not crossing

