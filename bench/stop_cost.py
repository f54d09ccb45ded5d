"""What the longest stop strings a request may send cost the engine's step, per generated token.

Stop strings are checked against each choice's text on every token, on the engine thread, so
their cost lands on every request in the batch. `SamplingParams` caps them (count, length each,
total); this measures the cap's worst case (a few strings of the longest allowed length that
never match, so every check scans all of them) against the same workload without stop strings,
in the same process, interleaved, and prints the ratios: one request of n choices with them among
requests without (what others pay), and every request with them.

    PYTHONPATH=. python -m bench.stop_cost [--rounds 9] [--requests 8] [--n 8] [--tokens 96]
"""

from __future__ import annotations

import argparse
import time

from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_TOTAL_CHARS, SamplingParams

ENGINE = dict(
    max_num_seqs=64,
    max_num_batched_tokens=128,
    max_model_len=512,
    block_size=8,
    num_blocks=1024,
    decode_batch_buckets=(64,),
    block_table_buckets=(64,),
    prefill_token_buckets=(128,),
    prefill_seq_buckets=(8,),
)


def longest_allowed_stops() -> list[str]:
    """As many strings of the longest allowed length as the total allows; characters the tiny
    model's text never holds, so no string ever matches and each check is a full scan."""
    count = MAX_STOP_TOTAL_CHARS // MAX_STOP_STRING_CHARS
    return [chr(0x2600 + i) * MAX_STOP_STRING_CHARS for i in range(count)]


def seconds_per_token(
    engine: LLMEngine, stops: list[str], with_stops: int, requests: int, n: int, tokens: int, tag: str
) -> float:
    """Seconds per generated token of `requests` requests of n choices, the first `with_stops`
    of them with `stops`."""
    for i in range(requests):
        params = SamplingParams(
            n=n, max_tokens=tokens, ignore_eos=True, temperature=1.0, seed=1, stop=stops if i < with_stops else []
        )
        engine.add_request(f"{tag}-{i}", [1, 2, 3, 4, 5], params)
    generated = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        generated += sum(len(d.token_ids) for d in engine.step())
    return (time.perf_counter() - t0) / generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    engine = LLMEngine(build_tiny_random(), EngineConfig(**ENGINE))
    engine.warm_up()
    stops = longest_allowed_stops()
    seconds_per_token(engine, stops, 1, 1, 1, 8, "warm")  # first use of every code path
    cases = {"no stop strings": 0, "one request with them": 1, "every request with them": args.requests}
    times: dict[str, list[float]] = {name: [] for name in cases}
    # Interleaved rounds, so drifts in machine load hit every case alike; each case's least
    # disturbed round (its minimum) is what it costs.
    for r in range(args.rounds):
        for name, with_stops in cases.items():
            times[name].append(
                seconds_per_token(engine, stops, with_stops, args.requests, args.n, args.tokens, f"{name}-{r}")
            )
    base = min(times["no stop strings"])
    print(f"workload: {args.requests} requests x n={args.n} x {args.tokens} tokens, tiny-random, {args.rounds} rounds")
    print(f"stop strings: {len(stops)} x {MAX_STOP_STRING_CHARS} chars (the caps' worst case)")
    for name in cases:
        t = min(times[name])
        print(f"per generated token, {name}: {t * 1e6:.1f} us, {t / base:.2f}x")


if __name__ == "__main__":
    main()
