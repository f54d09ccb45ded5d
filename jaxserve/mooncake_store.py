"""A `BlockStore` on Mooncake Store (`pip install 'jaxserve[mooncake]'`, plus the Debian package
`libibverbs1`, which the Python module links against even over TCP).

`--kv-pool mooncake://HOST:PORT` names the pool's master (`mooncake_master --rpc_port=PORT`).
This process joins the pool as a client that lends `segment_bytes` of its memory to it (the pool
is the sum of what its clients lend) and moves objects over TCP; the transfer metadata is
exchanged peer to peer (`P2PHANDSHAKE`) unless the URL names a metadata server
(`mooncake://HOST:PORT?metadata=http://HOST:PORT/metadata`).
"""

from __future__ import annotations

import ctypes.util
import os
import socket
import threading
from collections.abc import Sequence
from urllib.parse import parse_qs, urlsplit

from jaxserve.kv.block_store import FAILED, FULL, MISSING, UNAVAILABLE

SCHEME = "mooncake"
_NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
_NO_SPACE = -200  # NO_AVAILABLE_HANDLE: the pool's segments are full
_RPC_FAILED = range(-999, -899)  # RPC_FAIL and its kin: the master could not be reached
MASTER_PROBE_SECONDS = 3.0  # Mooncake's own setup retries an absent master for over a minute


def parse_pool_url(url: str) -> tuple[str, str]:
    """(master address HOST:PORT, metadata server or "P2PHANDSHAKE") of a `mooncake://` URL."""
    parts = urlsplit(url)
    if parts.scheme != SCHEME or not parts.hostname or parts.port is None:
        raise ValueError(f"--kv-pool must look like mooncake://HOST:PORT, got {url!r}")
    metadata = parse_qs(parts.query).get("metadata", ["P2PHANDSHAKE"])[0]
    return f"{parts.hostname}:{parts.port}", metadata


def _import_store():
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        hint = ""
        if ctypes.util.find_library("ibverbs") is None:
            hint = " and the Debian package libibverbs1 (apt-get install -y libibverbs1)"
        raise RuntimeError(f"--kv-pool needs Mooncake Store: pip install 'jaxserve[mooncake]'{hint} ({e})") from None
    return MooncakeDistributedStore


def _probe_master(master: str, url: str) -> None:
    """RuntimeError at once when nothing listens at the master's address (rather than after Mooncake's
    setup has retried it for over a minute)."""
    host, port = master.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=MASTER_PROBE_SECONDS).close()
    except OSError as e:
        raise RuntimeError(f"the KV pool's master at {url} does not answer ({e}): is mooncake_master up?") from None


def _code(result: int) -> int:
    if result >= 0:
        return result
    if result == _NOT_FOUND:
        return MISSING
    if result == _NO_SPACE:
        return FULL
    if result in _RPC_FAILED:
        return UNAVAILABLE
    return FAILED


class MooncakeBlockStore:
    """A `BlockStore` (block_store.py): this process as a client of a Mooncake Store pool. The
    client takes calls from several threads at once (the pool tier's writer, loader and lookups)."""

    def __init__(self, url: str, local_host: str, segment_bytes: int, buffer_bytes: int = 16 << 20) -> None:
        master, metadata = parse_pool_url(url)
        # Mooncake's transfer listeners bind every interface unless told otherwise: only this one.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_host)
        self._store = _import_store()()
        _probe_master(master, url)
        rc = self._store.setup(local_host, metadata, segment_bytes, buffer_bytes, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"could not join the KV pool at {url} (Mooncake setup returned {rc}): is its master up?")
        self._close_lock = threading.Lock()
        self._closed = False

    def register(self, address: int, nbytes: int) -> None:
        rc = self._store.register_buffer(address, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register {nbytes} bytes ({rc})")

    def exists(self, keys: Sequence[str]) -> list[int]:
        return [_code(r) if r < 0 else r for r in self._store.batch_is_exist(list(keys))]

    def put(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return [_code(r) for r in self._store.batch_put_from(list(keys), list(addresses), list(sizes))]

    def get(self, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        got = self._store.batch_get_into_multi_buffers(
            list(keys), [list(a) for a in addresses], [list(s) for s in sizes]
        )
        return [_code(r) for r in got]

    def close(self) -> None:
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self._store.close()
