"""The KV pool's control traffic over mutual TLS (server/cluster/pool_tls.py): a real
`mooncake_master` on loopback behind its gateway. A pool client that dials through a forwarder
with a certificate the cluster CA signed uses the pool; one with another CA's certificate is
refused at once, and a plain client never reaches the master."""

from __future__ import annotations

import time

import numpy as np
import pytest
from tls_certs import issue, make_ca

from jaxserve.mooncake_store import MooncakeBlockStore
from server.cluster.launch.mooncake_master import PoolMaster, mooncake_missing
from server.cluster.pool_tls import ForwarderProcess, cluster_tls_of_flags, pool_url_over_tls
from server.tls import ClusterTLS

if (why := mooncake_missing()) is not None:
    pytest.skip(why, allow_module_level=True)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d, "cluster-ca")
    certs = {"member": issue(ca, d, "member"), "rogue": issue(make_ca(d, "rogue-ca"), d, "rogue")}
    tls = {name: ClusterTLS.load(c.cert, c.key, ca.cert) for name, c in certs.items()}
    master = PoolMaster()
    master.start()
    gateway = ForwarderProcess("accept", "127.0.0.1:0", f"127.0.0.1:{master.rpc_port}", tls["member"])
    try:
        yield {"url": f"mooncake://{gateway.address}", "tls": tls, "ca": ca.cert, "certs": certs}
    finally:
        gateway.close()
        master.kill()
    assert gateway.proc.returncode == 0


def test_a_client_with_the_cluster_cert_uses_the_pool_through_the_gateway(pool):
    url, forwarder = pool_url_over_tls(pool["url"], pool["tls"]["member"])
    assert url != pool["url"] and url.startswith("mooncake://127.0.0.1:")
    store = MooncakeBlockStore(url, "127.0.0.1", 32 << 20)
    try:
        src, dst = np.arange(4096, dtype=np.uint8) % 251, np.zeros(4096, np.uint8)
        for array in (src, dst):
            store.register(array.ctypes.data, array.nbytes)
        assert store.put(["tls/a"], [src.ctypes.data], [src.nbytes]) == [0]
        assert store.exists(["tls/a", "tls/b"]) == [1, 0]
        assert store.get(["tls/a"], [[dst.ctypes.data, dst[1000:].ctypes.data]], [[1000, 3096]]) == [4096]
        np.testing.assert_array_equal(src, dst)
    finally:
        store.close()
        forwarder.close()
    assert forwarder.proc.returncode == 0  # it exits when its standard input closes


def test_a_cert_from_another_ca_is_refused_at_once(pool):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot be reached over TLS"):
        pool_url_over_tls(pool["url"], pool["tls"]["rogue"])
    assert time.monotonic() - t0 < 5


def test_a_plain_client_never_reaches_the_master(pool):
    with pytest.raises(RuntimeError, match="could not join the KV pool"):
        MooncakeBlockStore(pool["url"], "127.0.0.1", 32 << 20)


def test_a_metadata_server_is_not_carried_over_tls(pool):
    with pytest.raises(ValueError, match="metadata server"):
        pool_url_over_tls(pool["url"] + "?metadata=http://127.0.0.1:1/metadata", pool["tls"]["member"])


def test_the_launch_reads_the_workers_tls_files_from_their_flags(pool):
    member = pool["certs"]["member"]
    flags = ["--max-num-seqs", "8", "--cluster-tls-cert", str(member.cert), "--cluster-tls-key", str(member.key)]
    assert cluster_tls_of_flags(flags[:2]) is None
    assert cluster_tls_of_flags([*flags, "--cluster-tls-ca", str(pool["ca"])]).cert == member.cert.read_bytes()
    with pytest.raises(SystemExit, match="give all three"):
        cluster_tls_of_flags(flags)
