"""What a result was measured on: machine, accelerator and versions (recorded in every result JSON)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess
from typing import Any

_PACKAGES = ("jaxserve", "jax", "jaxlib", "flax", "numpy", "aiohttp", "tokenizers")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return round(pages * size / 2**30, 1)
    except (ValueError, OSError):
        return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def jax_devices() -> list[str]:
    """`platform:device_kind` of each JAX device (imports JAX; call only where it is loaded anyway)."""
    import jax

    return [f"{d.platform}:{d.device_kind}" for d in jax.devices()]


def system_info(include_jax_devices: bool = False) -> dict[str, Any]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "memory_gib": _memory_gib(),
        "gpus": _gpus(),
        "python": platform.python_version(),
        "os": platform.platform(),
        "versions": {p: _version(p) for p in _PACKAGES},
        "jax_platforms_env": os.environ.get("JAX_PLATFORMS"),
    }
    if include_jax_devices:
        info["jax_devices"] = jax_devices()
    accelerators = info["gpus"] or [d for d in info.get("jax_devices", []) if not d.startswith("cpu")]
    info["accelerator"] = ", ".join(accelerators) if accelerators else "none (CPU only)"
    return info
