"""One KV block per file (or per pool object, `pool_tier`): a fixed header, the block's token ids,
then its K and V bytes.

    magic "JXKVBLK1" | fingerprint 16 B | key 16 B | num_tokens u32 | payload_bytes u64 |
    crc32 u32 of (token ids + payload) | token ids (int32 x num_tokens) | payload

A file is written to a temporary name in its own directory and renamed over the final name
(`os.replace`, atomic on POSIX), so a reader (this process, another engine on the same
directory, the next start) sees a whole file or none, and two writers of one key never mix
their bytes. The checksum and the lengths catch what the rename cannot: a file truncated or
damaged on the disk, or torn by a power cut. `read_block` raises `DamagedBlockFile` for those;
the caller deletes the file and recomputes the block. A block is read straight into where its
payload goes (a host slot's K and V: `HostBlockArrays.slot_parts`) and checked there.
"""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np

MAGIC = b"JXKVBLK1"
_HEADER = struct.Struct("<8s16s16sIQI")
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp-"


class DamagedBlockFile(Exception):
    """A block file that is truncated, damaged, or not the block it is named after."""


def file_bytes(block_size: int, payload_bytes: int) -> int:
    """Size of a whole block file on disk."""
    return HEADER_BYTES + 4 * block_size + payload_bytes


def block_header(fingerprint: bytes, key: bytes, tokens: bytes, payload: list[memoryview]) -> bytes:
    """The header of a block (file or pool object) holding `tokens` and `payload`."""
    size = sum(part.nbytes for part in payload)
    crc = zlib.crc32(tokens)
    for part in payload:
        crc = zlib.crc32(part, crc)
    return _HEADER.pack(MAGIC, fingerprint, key, len(tokens) // 4, size, crc)


def write_block(path: Path, fingerprint: bytes, key: bytes, tokens: bytes, payload: list[memoryview]) -> int:
    """Write a block file atomically (temp file + rename); returns the bytes written."""
    header = block_header(fingerprint, key, tokens, payload)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX, suffix=SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(tokens)
            for part in payload:
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return HEADER_BYTES + len(tokens) + sum(part.nbytes for part in payload)


def read_header(path: Path) -> tuple[bytes, bytes, int, int]:
    """(fingerprint, key, num_tokens, payload_bytes) of a block file; DamagedBlockFile if the header
    is not one of ours or the file's length does not match it."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
        size = os.fstat(f.fileno()).st_size
    return _check_header(raw, size)


def _check_header(raw: bytes, size: int) -> tuple[bytes, bytes, int, int]:
    if len(raw) != HEADER_BYTES:
        raise DamagedBlockFile("shorter than a header")
    magic, fp, key, num_tokens, payload_bytes, _ = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise DamagedBlockFile("not a KV block file")
    if size != HEADER_BYTES + 4 * num_tokens + payload_bytes:
        raise DamagedBlockFile(f"{size} bytes, the header says {HEADER_BYTES + 4 * num_tokens + payload_bytes}")
    return fp, key, num_tokens, payload_bytes


def head_bytes(block_size: int) -> int:
    """Bytes before a block's payload: the header and (at most) `block_size` token ids."""
    return HEADER_BYTES + 4 * block_size


def read_block(
    path: Path, fingerprint: bytes, key: bytes, tokens: bytes, head: np.ndarray, parts: list[np.ndarray]
) -> None:
    """Read the block file at `path` straight into `head` (header and token ids: a buffer the reader
    keeps) and `parts` (its payload's destination, e.g. a host slot's K and V), and check it against
    everything expected of it. `parts` hold garbage when this raises.

    FileNotFoundError when there is no file (another engine evicted it); DamagedBlockFile when
    it is not exactly the block asked for, whole and unchanged."""
    head = head[: HEADER_BYTES + len(tokens)]
    expected = head.nbytes + sum(part.nbytes for part in parts)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != expected:
            raise DamagedBlockFile(f"{size} bytes, this block's file has {expected}")
        n = os.readv(fd, [head, *parts])
    finally:
        os.close(fd)
    if n != size:
        raise DamagedBlockFile("the file changed while it was read")
    check_block(head, parts, fingerprint, key, tokens, expected - head.nbytes)


def check_block(
    head: np.ndarray, parts: list[np.ndarray], fingerprint: bytes, key: bytes, tokens: bytes, payload_bytes: int
) -> None:
    """Check a block read as `head` (header and token ids) and `parts` (its payload, in order: a
    file's or a pool object's) against everything expected of it; DamagedBlockFile when it is not
    exactly the block asked for, whole and unchanged."""
    size = head.nbytes + sum(part.nbytes for part in parts)
    header = head[:HEADER_BYTES].tobytes()
    fp, found_key, num_tokens, found_payload = _check_header(header, size)
    if fp != fingerprint or found_key != key:
        raise DamagedBlockFile("the header names another block or model")
    if found_payload != payload_bytes or num_tokens * 4 != len(tokens):
        raise DamagedBlockFile("the block has another shape")
    crc = zlib.crc32(head[HEADER_BYTES:])
    for part in parts:
        crc = zlib.crc32(part, crc)
    if crc != _HEADER.unpack(header)[5]:
        raise DamagedBlockFile("checksum mismatch")
    if head[HEADER_BYTES:].tobytes() != tokens:
        raise DamagedBlockFile("the block holds other tokens")
