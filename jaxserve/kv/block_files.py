"""One KV block per file (or per pool object, `pool_tier`): a fixed header, the block's token ids,
then its K and V bytes.

    magic "JXKVBLK1" | fingerprint 16 B | key 16 B | num_tokens u32 | payload_bytes u64 |
    crc32 u32 of (token ids + payload) | token ids (int32 x num_tokens) | payload

A file is written to a temporary name in its own directory and renamed over the final name
(`os.replace`, atomic on POSIX), so a reader (this process, another engine on the same
directory, the next start) sees a whole file or none, and two writers of one key never mix
their bytes. The checksum and the lengths catch what the rename cannot: a file truncated or
damaged on the disk, or torn by a power cut. `read_block` raises `DamagedBlockFile` for those;
the caller deletes the file and recomputes the block.
"""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from pathlib import Path

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


def read_block(
    path: Path, fingerprint: bytes, key: bytes, tokens: bytes, payload_bytes: int, buffer: memoryview
) -> memoryview:
    """The payload of the block file at `path`, checked against everything expected of it, read
    into `buffer` (one the reader keeps: a fresh allocation per block would pay its page faults on
    every read). The payload is a view of `buffer`, valid until the next read into it.

    FileNotFoundError when there is no file (another engine evicted it); DamagedBlockFile when
    it is not exactly the block asked for, whole and unchanged."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > len(buffer):
            raise DamagedBlockFile(f"{size} bytes, more than a block file of this model")
        data = buffer[:size]
        n = f.readinto(data)
    if n != size:
        raise DamagedBlockFile("the file changed while it was read")
    return check_block(data, fingerprint, key, tokens, payload_bytes)


def check_block(data: memoryview, fingerprint: bytes, key: bytes, tokens: bytes, payload_bytes: int) -> memoryview:
    """The payload of a whole block's bytes (header, tokens, payload: a file's or a pool object's),
    checked against everything expected of it; DamagedBlockFile when it is not exactly the block
    asked for, whole and unchanged."""
    fp, found_key, num_tokens, size = _check_header(bytes(data[:HEADER_BYTES]), len(data))
    if fp != fingerprint or found_key != key:
        raise DamagedBlockFile("the header names another block or model")
    if size != payload_bytes or num_tokens * 4 != len(tokens):
        raise DamagedBlockFile("the block has another shape")
    body = data[HEADER_BYTES:]
    crc = _HEADER.unpack(bytes(data[:HEADER_BYTES]))[5]
    if zlib.crc32(body) != crc:
        raise DamagedBlockFile("checksum mismatch")
    if body[: len(tokens)] != tokens:
        raise DamagedBlockFile("the block holds other tokens")
    return body[len(tokens) :]
