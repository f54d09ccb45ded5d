"""The first disk hit after a restart against the next one and against recomputing, one process.

    python3 -m bench.kv_first_hit [--model smollm2-135m-instruct] [--tokens 1463]

Engine A computes two prompts of `--tokens` and closes (its blocks are on disk). Engine B, started
on the same directory, answers the first prompt (its first disk hit: every buffer the load path
touches is touched for the first time), then the second (a warm disk hit), then recomputes a third,
fresh prompt: time to the first token of each (max_tokens=1), and the tokens it found cached. The
machine is shared: compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import numpy as np

from jaxserve import LLM, SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def _engine(model: str, directory: str) -> LLM:
    return LLM(
        model,
        kv_disk_dir=directory,
        max_num_seqs=2,
        max_num_batched_tokens=512,
        max_model_len=2048,
        block_size=16,
        num_blocks=400,
        decode_batch_buckets=(2,),
        prefill_token_buckets=(32, 512),
        prefill_seq_buckets=(1,),
        max_prefill_seqs=1,
        kv_host_bytes=256 << 20,
        kv_disk_bytes=2 << 30,
        kv_disk_min_load_tokens=64,
    )


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt}, ONE_TOKEN, use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=1463)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    first, second, fresh = (rng.integers(100, 40000, args.tokens).tolist() for _ in range(3))
    directory = tempfile.mkdtemp(prefix="kv-first-hit-")
    try:
        writer = _engine(args.model, directory)
        for prompt in (first, second):
            writer.generate({"prompt_token_ids": prompt}, ONE_TOKEN, use_tqdm=False)
        writer.close()
        restarted = _engine(args.model, directory)
        rows = [("first disk hit", first), ("second disk hit", second), ("recompute", fresh)]
        results = [(name, *_ttft(restarted, prompt)) for name, prompt in rows]
        restarted.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    for name, seconds, cached in results:
        print(f"{name:16s} {seconds:7.3f} s  ({cached} tokens cached)")
    print(
        f"first / second hit: {results[0][1] / results[1][1]:.2f}x; recompute / second hit: "
        f"{results[2][1] / results[1][1]:.1f}x"
    )


if __name__ == "__main__":
    main()
