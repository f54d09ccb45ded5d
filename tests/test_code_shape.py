"""The tree's shape, checked on every CI run: ruff's lint and format (settings in pyproject.toml) and
the size limits a newcomer can read in an afternoon: no Python file over 400 lines, no function over
60 lines, no class over 25 methods, outside tests, kernels (kernels_pallas/) and generated gRPC code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("jaxserve", "server", "sharding", "checkpoints", "bench")
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_CLASS_METHODS = 400, 60, 25


def _over_limits(root: Path = ROOT, folders: tuple[str, ...] = CHECKED) -> set[str]:
    """Every file, function and class over its limit, as `path`, `path:function` and `path:Class`."""
    over = set()
    sources = (p for folder in folders for p in (root / folder).rglob("*.py"))
    for path in sorted(p for p in sources if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))):
        text = path.read_text()
        name = str(path.relative_to(root))
        if len(text.splitlines()) > MAX_FILE_LINES:
            over.add(name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    over.add(f"{name}:{node.name}")
            elif isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if methods > MAX_CLASS_METHODS:
                    over.add(f"{name}:{node.name}")
    return over


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(command: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_file_function_or_class_over_its_limit() -> None:
    over = sorted(_over_limits())
    assert not over, f"over the limits ({MAX_FILE_LINES} lines a file, {MAX_FUNCTION_LINES} a function, " + (
        f"{MAX_CLASS_METHODS} methods a class): {over}"
    )


def test_the_limits_are_measured(tmp_path: Path) -> None:
    """A function of 61 lines and a class of 26 methods are over; 60 lines and 25 methods are not;
    a 401-line file is over; generated gRPC code is not read."""

    def function(name: str, lines: int) -> str:
        return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(lines - 1))

    def cls(name: str, methods: int) -> str:
        return f"class {name}:\n" + "".join(f"    def m{i}(self): pass\n" for i in range(methods))

    (tmp_path / "pkg").mkdir()
    source = function("fits", 60) + function("long", 61) + cls("Fits", 25) + cls("Big", 26)
    (tmp_path / "pkg" / "a.py").write_text(source)
    (tmp_path / "pkg" / "b.py").write_text("x = 0\n" * 401)
    (tmp_path / "pkg" / "c_pb2.py").write_text("x = 0\n" * 401)
    assert _over_limits(tmp_path, ("pkg",)) == {"pkg/a.py:long", "pkg/a.py:Big", "pkg/b.py"}
