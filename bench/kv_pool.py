"""A prompt computed by one engine, its prefix read by another from the shared KV pool (Mooncake
Store, a real master on loopback), same run: TTFT of the pool hit against recomputing a fresh prompt
of the same length, for each of `--tokens`; and the pool's read bandwidth into the KV host tier
(in the runs, and loading `--bandwidth-bytes` of the model's blocks on their own) against a plain
copy of the same bytes and against the store's own loopback transfer.

    python3 -m bench.kv_pool [--model smollm2-135m-instruct] [--tokens 1000 4000 8000]

Engine A computes each prompt (its blocks are written through to the pool); engine B, which never
saw it, then takes the pool hit, and recomputes a fresh prompt of the same length. Both engines live
in this process and share its cores: compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from bench.kv_tiers import ttft
from checkpoints.registry import cache_dir
from jaxserve import LLM
from jaxserve.kv import HostBlockArrays, PoolTier, fingerprint
from jaxserve.mooncake_store import MooncakeBlockStore
from server.cluster.launch.mooncake_master import PoolMaster, mooncake_missing


def _engine_config(max_tokens: int, pool: str) -> dict[str, Any]:
    bs = 16
    max_len = -(-(max_tokens + 64) // 512) * 512
    return dict(
        max_num_seqs=2,
        max_num_batched_tokens=512,
        max_model_len=max_len,
        block_size=bs,
        num_blocks=2 * max_len // bs + 64,
        decode_batch_buckets=(2,),
        prefill_token_buckets=(32, 512),
        prefill_seq_buckets=(1,),
        max_prefill_seqs=1,
        kv_host_bytes=1 << 30,
        kv_disk_min_load_tokens=64,
        kv_pool=pool,
        kv_pool_segment_bytes=2 << 30,
        compilation_cache_dir=str(cache_dir() / "xla"),
    )


def store_bandwidth(url: str, nbytes: int) -> dict[str, float]:
    """GB/s of a numpy copy of `nbytes`, and of one put and one get of that many bytes through the pool."""
    store = MooncakeBlockStore(url, "127.0.0.1", nbytes + (64 << 20))
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)  # its pages touched: the copy below does not time page faults
    store.register(src.ctypes.data, src.nbytes)
    store.register(dst.ctypes.data, dst.nbytes)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    copy = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert store.put(["bench/bandwidth"], [src.ctypes.data], [nbytes]) == [0]
    put = time.perf_counter() - t0
    dst[:] = 0
    t0 = time.perf_counter()
    assert store.get(["bench/bandwidth"], [[dst.ctypes.data]], [[nbytes]]) == [nbytes]
    get = time.perf_counter() - t0
    assert np.array_equal(src, dst)
    store.close()
    return {"copy_gbps": nbytes / copy / 1e9, "pool_put_gbps": nbytes / put / 1e9, "pool_get_gbps": nbytes / get / 1e9}


def host_tier_read(
    url: str, block_shape: tuple[int, ...], num_blocks: int, dtype: Any, repeats: int = 3
) -> dict[str, float]:
    """GB/s of the pool tier's loads of `num_blocks` blocks ([layers, kv heads, block size, head dim]
    of K and of V each) into the host tier's slots, written by another client of the same pool:
    the best of `repeats` loads, each into slots it had not touched since the last."""
    layers, heads, block_size, head_dim = block_shape
    shape = (layers, heads, num_blocks, block_size, head_dim)
    budget = 2 * num_blocks * int(np.prod(block_shape)) * np.dtype(dtype).itemsize + (64 << 20)
    tiers = []
    for _ in range(2):
        host = HostBlockArrays([HostBlockArrays.allocate(shape, dtype) for _ in range(2)])
        store = MooncakeBlockStore(url, "127.0.0.1", budget)
        tiers.append(PoolTier(store, fingerprint({"bench": "host_tier_read"}), block_size, host, budget))
    writer, reader = tiers
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 1 << 30, block_size, dtype=np.int32).tobytes() for _ in range(num_blocks)]
    keys = [i.to_bytes(16, "little") for i in range(num_blocks)]
    for a in writer.host.arrays:
        a[...] = rng.standard_normal(a.shape).astype(dtype)
    writer.write([writer.plan_write(k, t) for k, t in zip(keys, tokens)], writer.host.arrays)
    writer.flush()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        job = reader.start_load(keys, tokens, list(range(num_blocks)))
        while not job.done:
            reader.wait(1.0)
        best = min(best, time.perf_counter() - t0)
        assert job.loaded == num_blocks and reader.poll() == [job]
    for w, r in zip(writer.host.arrays, reader.host.arrays):
        assert np.array_equal(w, r)
    for tier in tiers:
        tier.close()
    return {
        "blocks": num_blocks,
        "bytes": num_blocks * reader.object_bytes,
        "load_gbps": num_blocks * reader.object_bytes / best / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000, 8000])
    parser.add_argument("--bandwidth-bytes", type=int, default=256 << 20)
    args = parser.parse_args()
    if (why := mooncake_missing()) is not None:
        raise SystemExit(why)
    master = PoolMaster()
    master.start()
    try:
        config = _engine_config(max(args.tokens), master.url)
        a, b = LLM(args.model, **config), LLM(args.model, **config)
        vocab = a.engine.model_config.vocab_size
        rng = np.random.default_rng(0)
        results: dict[str, Any] = {"model": args.model, "runs": {}}
        for n in args.tokens:
            prompt, fresh = (rng.integers(100, min(40000, vocab), n).tolist() for _ in range(2))
            computed = ttft(a, prompt, f"{n} tokens, engine A computes")
            a.engine.step()  # the write-through copies the run planned ...
            a.engine.lower_tier.flush()  # ... and the pool's puts, so B's timings do not share the CPU with them
            hit = ttft(b, prompt, f"{n} tokens, engine B from the pool")
            cold = ttft(b, fresh, f"{n} tokens, engine B recomputes a fresh prompt")
            assert hit["first_token"] == computed["first_token"], "the pool hit changed the first token"
            results["runs"][n] = {
                "a_computed": computed,
                "b_pool_hit": hit,
                "b_recompute": cold,
                "recompute_over_hit": cold["ttft_s"] / hit["ttft_s"],
            }
        stats = b.engine.lower_tier.stats
        results["pool_read_gbps"] = stats.bytes_read / max(stats.load_seconds, 1e-9) / 1e9
        host_k = b.engine.lower_tier.host.arrays[0]  # [layers, kv heads, host slots, block size, head dim]
        block = (*host_k.shape[:2], *host_k.shape[3:])
        a.close(), b.close()
        blocks = args.bandwidth_bytes // (2 * host_k[:, :, 0].nbytes)
        results["host_tier_read"] = host_tier_read(master.url, block, blocks, host_k.dtype)
        results["machine"] = store_bandwidth(master.url, args.bandwidth_bytes)
    finally:
        master.kill()
    print(json.dumps(results, indent=1))
    for n, run in results["runs"].items():
        hit, cold = run["b_pool_hit"]["ttft_s"], run["b_recompute"]["ttft_s"]
        print(f"{n} tokens: pool hit {hit:.3f} s, recompute {cold:.3f} s: {run['recompute_over_hit']:.2f}x")
    m = results["machine"]
    read = results["host_tier_read"]
    print(
        f"pool reads into the host tier {results['pool_read_gbps']:.2f} GB/s in the runs, "
        f"{read['load_gbps']:.2f} GB/s loading {read['blocks']} blocks on their own; the store's own get "
        f"{m['pool_get_gbps']:.2f} GB/s, put {m['pool_put_gbps']:.2f} GB/s; numpy copy {m['copy_gbps']:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
