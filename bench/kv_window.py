"""Blocks a sequence holds with window-sized caches against the whole cache, measured in the engine:

    python3 -m bench.kv_window [--tokens 4096] [--prompt 1024] [--window 512]

One request of `--prompt` tokens decodes until it holds `--tokens`, served by the tiny random Mistral
with a window of `--window` tokens (blocks of 16) three ways: every block kept
(`sliding_window_kv=False`, as before), window-sized with prefix caching (the prompt's blocks stay
cached, locked until the window leaves them) and without it. Printed: the most blocks the sequence
held while its prompt was prefilled (chunks of 256) and while decoding once its prompt left the window,
the blocks held at the end, and what the blocks at
the end would weigh at Mistral 7B v0.1's shape (32 layers, 8 kv heads of 128, bf16: 2 MiB a block). Block
counts do not depend on the model's size; the tiny one keeps the run short.
"""

from __future__ import annotations

import argparse
import dataclasses

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams

BLOCK = 16
MISTRAL_7B_BLOCK_BYTES = BLOCK * 32 * 8 * 128 * 2 * 2  # tokens x layers x kv heads x head dim x (K, V) x bf16


def held_blocks(tokens: int, prompt: int, window: int, **engine: object) -> tuple[int, int, int]:
    """(most blocks held while prefilling, most once the prompt left the window, at the end) of one request."""
    model = build_tiny_random(family="mistral")
    config = dataclasses.replace(model.config, sliding_window=window, max_position_embeddings=2 * tokens)
    llm = LLM(
        dataclasses.replace(model, config=config),
        block_size=BLOCK,
        max_model_len=tokens + BLOCK,
        num_blocks=tokens // BLOCK + 64,
        max_num_seqs=1,
        max_num_batched_tokens=256,
        decode_batch_buckets=(1,),
        prefill_token_buckets=(256,),
        prefill_seq_buckets=(1,),
        **engine,
    )
    core = llm.engine
    (req,) = core.add_prompt_ids(
        "r", list(range(3, 3 + prompt)), SamplingParams(max_tokens=tokens - prompt, ignore_eos=True)
    )
    prefill = most = last = 0
    while core.has_unfinished_requests():
        core.step()
        if req.kv is not None and req.kv.is_live:
            last = core.kv.usage().used  # held, or cached and locked by it
            if req.num_computed_tokens <= prompt:
                prefill = max(prefill, last)
            elif req.num_computed_tokens > prompt + window + BLOCK:
                most = max(most, last)
    llm.close()
    return prefill, most, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    print(
        f"one sequence: {args.prompt} prompt tokens, decoded to {args.tokens}; window {args.window}; blocks of {BLOCK}"
    )
    print(f"{'cache':<34} {'most in prefill':>15} {'most past window':>17} {'at end':>7} {'Mistral 7B':>11}")
    for name, engine in (
        ("whole (sliding_window_kv=False)", dict(sliding_window_kv=False)),
        ("window-sized, prefix caching on", {}),
        ("window-sized, prefix caching off", dict(enable_prefix_caching=False)),
    ):
        prefill, most, last = held_blocks(args.tokens, args.prompt, args.window, **engine)
        mib = last * MISTRAL_7B_BLOCK_BYTES / 2**20
        print(f"{name:<34} {prefill:>15} {most:>17} {last:>7} {mib:>7.0f} MiB")


if __name__ == "__main__":
    main()
