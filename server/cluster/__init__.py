"""The cluster: engines in other processes behind the public server.

`router/` is `jaxserve router`: the public server (`server/`) over worker processes, through
`RemoteEngine`, which implements the same `jaxserve.engine_client.EngineClient` as the engine of
one process. `worker/` is `jaxserve worker`: one engine behind the internal `Worker` gRPC service,
and the KV handoff of prefill/decode disaggregation. `launch/` is `jaxserve launch`: a router and
its workers placed on a Ray cluster. Like the server, this package uses only the engine interface
and its public types, and the placement it shares with the in-process data-parallel engine
(`jaxserve.placement`; tests/test_layering.py).
"""

from __future__ import annotations

import argparse


def host_port(text: str, *, listening: bool = False) -> str:
    """An argparse type: `text` if it is HOST:PORT (a worker's, a pool's; port 0, a free one, only
    where this process listens), else the parser's error."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if listening else 1) <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"an address is HOST:PORT, got {text!r}")
    return text


def listen_host_port(text: str) -> str:
    """`host_port` of an address this process listens at (port 0: a free one)."""
    return host_port(text, listening=True)
