"""What `--quantization auto` buys on a model: offline decode speed of `auto` against `none`, same run.

Two engines of one model (`--dtype auto` both), built in one process; one code prompt, greedy, alone and
`--streams` at once; rounds alternate between the engines and the best of each is kept (the machines are
shared and noisy: only the ratio counts). Prints each mode's tok/s, the ratios, and whether the greedy tokens
of the two modes are identical.

    python3 -m bench.quantization_auto [--model qwen2.5-coder-0.5b-instruct] [--tokens 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import time

from jaxserve import LLM, SamplingParams

PROMPT = 'def quicksort(items):\n    """Sort a list of numbers."""\n'


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    engine = dict(
        dtype="auto",
        max_num_seqs=args.streams,
        max_model_len=1024,
        max_num_batched_tokens=256,
        decode_batch_buckets=(1, args.streams),
        prefill_token_buckets=(256,),
        prefill_seq_buckets=(1, 4),
    )
    llms = {mode: LLM(args.model, quantization=mode, **engine) for mode in ("none", "auto")}
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    batch = [PROMPT + f"# {i}\n" for i in range(args.streams)]
    best = {mode: [float("inf"), float("inf")] for mode in llms}
    tokens = {}
    for _ in range(args.rounds):
        for mode, llm in llms.items():
            t = time.perf_counter()
            tokens[mode] = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
            best[mode][0] = min(best[mode][0], time.perf_counter() - t)
            t = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            best[mode][1] = min(best[mode][1], time.perf_counter() - t)
    for mode, llm in llms.items():
        one, many = args.tokens / best[mode][0], args.streams * args.tokens / best[mode][1]
        print(f"{args.model} {mode} ({llm.engine.config.quantization}): 1 stream {one:.1f} tok/s, "
              f"{args.streams} streams {many:.1f} tok/s")  # fmt: skip
    print(
        f"auto / none: 1 stream {best['none'][0] / best['auto'][0]:.2f}x, {args.streams} streams "
        f"{best['none'][1] / best['auto'][1]:.2f}x; greedy tokens identical: {tokens['none'] == tokens['auto']}"
    )


if __name__ == "__main__":
    main()
