"""The layering of the repository, checked by import-linter with the contracts in pyproject.toml:
the public server and the cluster use only the engine interface (`jaxserve.engine_client`) and its
public types; the engine imports neither of them; the KV and scheduling layers import no JAX; the scheduler
does not know how drafts are made (it asks a `Proposer`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "server", "bench", "checkpoints", "sharding", "kernels_pallas")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    """import-linter over the packages under `tree`, with the repository's contracts."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def _copy_tree(dst: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, dst / package, ignore=shutil.ignore_patterns("*.pyc", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")


def test_the_repository_keeps_its_layering_contracts(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, line",
    [
        ("server/sse.py", "import jaxserve.engine"),
        ("server/cluster/router/sequence.py", "from jaxserve.kv.manager import KVCacheManager"),
        ("server/cluster/worker/service.py", "from jaxserve.async_engine import AsyncEngine"),
        ("jaxserve/engine.py", "import server.app"),
        ("jaxserve/scheduler/scheduler.py", "import jax"),
        ("jaxserve/scheduler/scheduler.py", "from jaxserve.speculative.ngram import propose_ngram"),
    ],
)
def test_an_import_across_a_boundary_breaks_the_check(tmp_path: Path, module: str, line: str) -> None:
    _copy_tree(tmp_path)
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{line}\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "1 broken" in result.stdout
    assert module.removesuffix(".py").replace("/", ".") in result.stdout
