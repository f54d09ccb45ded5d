"""Mutual TLS for the KV pool's control traffic.

Mooncake Store's master speaks plain RPC over TCP, so a cluster that runs on TLS
(`--cluster-tls-cert/--cluster-tls-key/--cluster-tls-ca`) carries it through a forwarder at each end:

    worker: Mooncake client -> 127.0.0.1:P -- forwarder (dial) ==(mutual TLS)==> gateway HOST:PORT
    master's node:  gateway HOST:PORT -- forwarder (accept) --> mooncake_master on 127.0.0.1:Q

A worker given `--kv-pool mooncake://HOST:PORT` and the cluster TLS flags dials the master through
a forwarder of its own (`pool_url_over_tls`): each connection the pool's client opens to a loopback
port goes on to HOST:PORT over TLS, presenting the worker's certificate and checking the gateway's
against the CA and HOST. The gateway (`jaxserve kv-pool-gateway`, or `jaxserve launch` for a
topology whose workers carry the TLS flags) accepts only clients whose certificate the CA signed,
and forwards them to a master that listens on loopback only. A client without such a certificate
never reaches the master.

Each forwarder is a process of its own: Mooncake's client holds the GIL through some of its calls
(its setup among them), so a forwarder on a thread of the worker would wait on the very call it
carries. A worker's forwarder exits when the worker does (its standard input closes).

Not covered: the KV objects themselves move between the pool's clients in Mooncake's TCP transport
(each worker's `--kv-pool-local-host`), which has no TLS: keep those addresses on a private network.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Sequence
from urllib.parse import urlsplit

from server.cluster import host_port, listen_host_port
from server.tls import ClusterTLS, add_cluster_tls_args, cluster_tls_from_args

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0  # seconds to reach the far end and finish the TLS handshake
_CHUNK = 1 << 16


async def forward(
    listen: tuple[str, int], target: tuple[str, int], accept_tls: ssl.SSLContext | None, dial_tls: ssl.SSLContext | None
) -> asyncio.Server:
    """Accept TCP connections at `listen` and carry each to `target`, with TLS on the accepting side
    (a gateway), on the dialling side (a worker's forwarder), or neither; the listening server."""
    host, port = target

    async def carry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            far_reader, far_writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=dial_tls, server_hostname=host if dial_tls else None),
                CONNECT_TIMEOUT,
            )
        except (OSError, ssl.SSLError, TimeoutError) as e:
            logger.warning("KV pool forwarder: cannot reach %s:%d (%s)", host, port, e)
            writer.close()
            return
        await asyncio.gather(_pump(reader, far_writer), _pump(far_reader, writer))

    handshake = {"ssl": accept_tls, "ssl_handshake_timeout": CONNECT_TIMEOUT} if accept_tls else {}
    return await asyncio.start_server(carry, *listen, **handshake)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (OSError, ssl.SSLError):
        pass  # either end went away: close the other
    finally:
        writer.close()


def check_gateway(host: str, port: int, tls: ClusterTLS) -> None:
    """RuntimeError at once, with the reason, when the gateway at HOST:PORT cannot be reached or
    the TLS handshake with it fails: a wrong CA on either side, a certificate that does not name
    HOST. (TLS 1.2 here: in 1.3 a server's refusal of the client's certificate comes after the
    client has finished its handshake.)"""
    ctx = tls.ssl_context(server_side=False)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT) as raw:
            with ctx.wrap_socket(raw, server_hostname=host):
                pass
    except (OSError, ssl.SSLError) as e:
        raise RuntimeError(f"the KV pool's TLS gateway at {host}:{port} cannot be reached over TLS ({e})") from None


class ForwarderProcess:
    """`python3 -m server.cluster.pool_tls` as a child process (it exits with this one); `address`
    is where it listens."""

    def __init__(self, mode: str, listen: str, target: str, tls: ClusterTLS) -> None:
        cert, key, ca = tls.files
        flags = ["--cluster-tls-cert", cert, "--cluster-tls-key", key, "--cluster-tls-ca", ca]
        argv = [sys.executable, "-m", "server.cluster.pool_tls", mode, "--listen", listen, "--to", target]
        argv += ["--until-stdin-closes", *flags]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.close()
            raise RuntimeError(f"the KV pool's TLS forwarder did not start (it exited with {self.proc.returncode})")
        self.address = line.split()[-1]

    def close(self) -> None:
        """Stop it (closing its standard input, which it watches). Idempotent."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def pool_url_over_tls(url: str, tls: ClusterTLS) -> tuple[str, ForwarderProcess]:
    """The `--kv-pool` URL a worker's pool client dials instead of `url` (a loopback forwarder that
    carries its master RPC to the gateway at url's address over mutual TLS), and that forwarder."""
    parts = urlsplit(url)
    if parts.query:
        raise ValueError("--kv-pool with cluster TLS: a metadata server (?metadata=) is not carried over TLS")
    if not parts.hostname or parts.port is None:
        raise ValueError(f"--kv-pool must look like mooncake://HOST:PORT, got {url!r}")
    check_gateway(parts.hostname, parts.port, tls)
    forwarder = ForwarderProcess("dial", "127.0.0.1:0", f"{parts.hostname}:{parts.port}", tls)
    logger.info(
        "KV pool master RPC to %s:%d over mutual TLS (through %s)", parts.hostname, parts.port, forwarder.address
    )
    return f"{parts.scheme}://{forwarder.address}", forwarder


def cluster_tls_of_flags(flags: Sequence[str]) -> ClusterTLS | None:
    """The cluster TLS files a command line names (a topology's worker flags), loaded; None if none."""
    p = argparse.ArgumentParser(add_help=False)
    add_cluster_tls_args(p.add_argument_group())
    return cluster_tls_from_args(p.parse_known_args(list(flags))[0])


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def add_gateway_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "kv-pool-gateway",
        help="the KV pool master's mutual-TLS front: clients with a CA-signed certificate reach a loopback master",
    )
    p.add_argument(
        "--listen", type=listen_host_port, required=True, metavar="HOST:PORT", help="where workers dial it (--kv-pool)"
    )
    p.add_argument(
        "--master", dest="to", type=host_port, required=True, metavar="HOST:PORT", help="the master's RPC (on loopback)"
    )
    add_cluster_tls_args(p.add_argument_group("cluster TLS (required)"))
    p.set_defaults(func=lambda args: run_forwarder(args, "accept"))
    return p


def run_forwarder(args: argparse.Namespace, mode: str) -> int:
    """Forward until SIGTERM/SIGINT (or, `--until-stdin-closes`, until standard input closes)."""
    import signal

    tls = cluster_tls_from_args(args)
    if tls is None:
        raise SystemExit("the KV pool's TLS forwarder needs --cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca")
    listen, target = _split(args.listen), _split(args.to)
    accept, dial = (tls.ssl_context(True), None) if mode == "accept" else (None, tls.ssl_context(False))

    async def run() -> None:
        server = await forward(listen, target, accept, dial)
        host, port = server.sockets[0].getsockname()[:2]
        print(f"listening on {host}:{port}", flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if getattr(args, "until_stdin_closes", False):  # a child of the process it serves

            def watch() -> None:
                sys.stdin.read()
                loop.call_soon_threadsafe(stop.set)

            threading.Thread(target=watch, daemon=True).start()
        await stop.wait()
        server.close()

    asyncio.run(run())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m server.cluster.pool_tls", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("accept", "dial"), help="TLS on the accepting (a gateway) or dialling side")
    p.add_argument("--listen", type=listen_host_port, required=True, metavar="HOST:PORT")
    p.add_argument("--to", type=host_port, required=True, metavar="HOST:PORT")
    p.add_argument("--until-stdin-closes", action="store_true", help="exit when standard input closes (a child)")
    add_cluster_tls_args(p.add_argument_group("cluster TLS"))
    args = p.parse_args(argv)
    return run_forwarder(args, args.mode)


if __name__ == "__main__":
    sys.exit(main())
