"""TLS: mutual TLS on the cluster's gRPC channels, and HTTPS for the public server.

Cluster traffic (router -> worker, decode worker -> prefill worker) runs over gRPC. With
`--cluster-tls-cert/--cluster-tls-key/--cluster-tls-ca` every process presents its own certificate
and accepts only peers whose certificate the CA signed: a worker refuses a client without one
(`require_client_auth`), and a router or worker refuses a worker whose certificate does not name
the address it dialled (gRPC checks the server's subject alternative names against the host).
One certificate per process serves both ends, so it must allow server and client authentication.

The public server (`jaxserve serve`, `jaxserve router`) serves HTTPS with `--ssl-certfile` and
`--ssl-keyfile` (vLLM's names), and its gRPC API (`--grpc-port`) TLS with the same files; with
`--ssl-ca-certs` both also require client certificates signed by those CAs.

Files are read and checked once at start, so that a missing file, one that is not PEM, or a key
that does not belong to its certificate stops the command with a message naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import ssl
from collections.abc import Sequence
from pathlib import Path

import grpc


class TLSConfigError(ValueError):
    """A TLS file is missing, unreadable, not PEM, or does not match its partner."""


def _read(path: str | Path, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise TLSConfigError(f"{flag}: no such file {str(path)!r}") from None
    except OSError as e:
        raise TLSConfigError(f"{flag}: cannot read {str(path)!r} ({e.strerror})") from None
    if b"-----BEGIN " not in data:
        raise TLSConfigError(f"{flag}: {str(path)!r} is not a PEM file")
    return data


def _check_pair(cert: str | Path, key: str | Path, flags: str) -> None:
    """That `key` is the private key of `cert` (OpenSSL's own check)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cert), str(key))
    except ssl.SSLError as e:
        raise TLSConfigError(f"{flags}: the key does not match the certificate, or one does not parse ({e})") from None


def _check_ca(ca: str | Path, flag: str) -> None:
    try:
        ssl.create_default_context(cafile=str(ca))
    except ssl.SSLError as e:
        raise TLSConfigError(f"{flag}: {str(ca)!r} holds no usable CA certificate ({e})") from None


@dataclasses.dataclass(frozen=True)
class ClusterTLS:
    """This process's certificate and key, and the CA its peers' certificates must chain to (PEM)."""

    cert: bytes
    key: bytes
    ca: bytes
    files: tuple[str, str, str]  # the three paths (Python's ssl loads a chain from files only; child processes)

    @classmethod
    def load(cls, cert: str | Path, key: str | Path, ca: str | Path) -> ClusterTLS:
        loaded = cls(
            _read(cert, "--cluster-tls-cert"),
            _read(key, "--cluster-tls-key"),
            _read(ca, "--cluster-tls-ca"),
            (str(cert), str(key), str(ca)),
        )
        _check_pair(cert, key, "--cluster-tls-cert/--cluster-tls-key")
        _check_ca(ca, "--cluster-tls-ca")
        return loaded

    def ssl_context(self, server_side: bool) -> ssl.SSLContext:
        """A plain TLS endpoint's context (the KV pool's control traffic: server/cluster/pool_tls.py):
        it presents our certificate and requires the peer's to chain to the CA (a server requires
        a client certificate; a client checks the server's name too)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(*self.files[:2])
        ctx.load_verify_locations(cadata=self.ca.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def server_credentials(self) -> grpc.ServerCredentials:
        """A listener that presents our certificate and refuses clients without a CA-signed one."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client that checks the server against the CA and presents our certificate."""
        return grpc.ssl_channel_credentials(self.ca, private_key=self.key, certificate_chain=self.cert)


def open_channel(address: str, tls: ClusterTLS | None, options: Sequence[tuple[str, object]]) -> grpc.aio.Channel:
    """An asyncio channel to a cluster peer: mutual TLS when `tls` is given, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=list(options))


def add_listening_port(server: grpc.aio.Server, bind: str, tls: ClusterTLS | None) -> int:
    """Bind `server` to `bind` (mutual TLS when `tls` is given); returns the port bound."""
    if tls is None:
        return server.add_insecure_port(bind)
    return server.add_secure_port(bind, tls.server_credentials())


def add_cluster_tls_args(g: argparse._ArgumentGroup) -> None:
    """The mutual-TLS flags of every process on the cluster's gRPC (router, worker, launch)."""
    g.add_argument(
        "--cluster-tls-cert",
        default=None,
        metavar="PEM",
        help="this process's certificate for the cluster's gRPC (mutual TLS; give with --cluster-tls-key and "
        "--cluster-tls-ca). It must name the addresses peers dial it at, and allow server and client use",
    )
    g.add_argument("--cluster-tls-key", default=None, metavar="PEM", help="the private key of --cluster-tls-cert")
    g.add_argument(
        "--cluster-tls-ca",
        default=None,
        metavar="PEM",
        help="the CA that signed every cluster process's certificate; peers without one are refused",
    )


def cluster_tls_from_args(args: argparse.Namespace) -> ClusterTLS | None:
    """The loaded files of the --cluster-tls-* flags, None when none is given; SystemExit with the
    reason when only some are given or a file is wrong."""
    paths = (args.cluster_tls_cert, args.cluster_tls_key, args.cluster_tls_ca)
    if not any(paths):
        return None
    if not all(paths):
        raise SystemExit("give all three of --cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca, or none")
    try:
        return ClusterTLS.load(*paths)
    except TLSConfigError as e:
        raise SystemExit(str(e)) from None


def add_https_args(g: argparse._ArgumentGroup) -> None:
    """HTTPS for the public server (vLLM's flag names)."""
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM; with --ssl-keyfile)")
    g.add_argument("--ssl-keyfile", default=None, help="the private key of --ssl-certfile (PEM)")
    g.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="require client certificates signed by these CAs (PEM) on the HTTPS server",
    )


def public_grpc_credentials(
    certfile: str | None, keyfile: str | None, ca_certs: str | None
) -> grpc.ServerCredentials | None:
    """The public gRPC API's TLS, from the same files as HTTPS (checked by `https_context` at
    start); None (plaintext) without a certificate."""
    if certfile is None or keyfile is None:
        return None
    pair = [(Path(keyfile).read_bytes(), Path(certfile).read_bytes())]
    if ca_certs is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=Path(ca_certs).read_bytes(), require_client_auth=True)


def https_context(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> ssl.SSLContext | None:
    """The server-side TLS context for the given files; None (plain HTTP) when no certificate is
    given. Raises TLSConfigError naming the flag at fault."""
    if certfile is None and keyfile is None:
        if ca_certs is not None:
            raise TLSConfigError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile (HTTPS)")
        return None
    if certfile is None or keyfile is None:
        raise TLSConfigError("give both --ssl-certfile and --ssl-keyfile, or neither")
    _read(certfile, "--ssl-certfile")
    _read(keyfile, "--ssl-keyfile")
    _check_pair(certfile, keyfile, "--ssl-certfile/--ssl-keyfile")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    if ca_certs is not None:
        _read(ca_certs, "--ssl-ca-certs")
        _check_ca(ca_certs, "--ssl-ca-certs")
        context.load_verify_locations(cafile=ca_certs)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
