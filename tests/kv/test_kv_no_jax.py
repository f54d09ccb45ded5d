"""jaxserve/kv is the hot host-side path: plain Python + numpy, no JAX (see DESIGN.md)."""

import ast
from pathlib import Path

import jaxserve.kv

ALLOWED_ROOTS = {
    "__future__",
    "array",
    "collections",
    "dataclasses",
    "enum",
    "itertools",
    "typing",
    "numpy",
    "jaxserve",
    # the disk tier: files, checksums, content hashes and its I/O threads
    "hashlib",
    "logging",
    "os",
    "pathlib",
    "queue",
    "struct",
    "tempfile",
    "threading",
    "time",
    "zlib",
    "concurrent",  # the pool tier's checker thread (concurrent.futures)
}


def test_kv_imports_only_the_standard_library_numpy_and_itself() -> None:
    package = Path(jaxserve.kv.__file__).parent
    files = sorted(package.glob("*.py"))
    assert len(files) >= 6
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                assert root in ALLOWED_ROOTS, f"{path.name} imports {name}"
                if root == "jaxserve":
                    assert name.startswith("jaxserve.kv"), f"{path.name} imports {name}"
