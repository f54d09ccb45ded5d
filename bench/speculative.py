"""N-gram speculative decoding against plain decoding, measured in the same run.

Two engines share one model's weights: one with `--speculative-config` (n-gram drafts), one
without. For each batch size and workload they generate the same greedy requests, interleaved
over rounds, and the bench prints each one's generated tokens/s, the ratio spec / plain, and the
acceptance rate (accepted drafts / verified drafts) with the tokens gained per verify step.
Greedy outputs are checked to be identical. Workloads:

- `copy`: the chat model is asked to repeat a given passage word for word (an editing or
  summarising task whose output copies its input: n-grams recur);
- `open`: open-ended requests (a short story on a topic), where the output rarely repeats.

    PYTHONPATH=. python -m bench.speculative [--model smollm2-135m-instruct] [--batches 1 32]
        [--tokens 96] [--rounds 2] [--k 4] [--lookup-min 2] [--lookup-max 4] [--disable-by-batch-size 8]

By default a batch above `--disable-by-batch-size` does not speculate (its ratio shows the
policy costs nothing there); raise it to see what speculating at that batch would give.
"""

from __future__ import annotations

import argparse
import statistics
import time

from checkpoints.registry import DEFAULT_MODEL, cache_dir, load_model
from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams

SENTENCES = [
    "The harbour town wakes before dawn, when the fishing boats slip out past the lighthouse.",
    "By noon the market square is full of traders selling bread, cheese, rope and tar.",
    "Children run along the sea wall while their grandparents argue about the weather.",
    "In the afternoon the wind turns, and the gulls settle on the roofs of the warehouses.",
    "The old ferry still crosses to the island twice a day, carrying post and passengers.",
    "Every spring the council promises to mend the road to the quarry, and every autumn it forgets.",
    "At dusk the boats come home low in the water, and the whole town walks down to meet them.",
    "Late at night only the bakery is lit, its ovens warming the street for the next morning.",
]
TOPICS = [
    "a dragon",
    "a lost key",
    "a robot chef",
    "the moon",
    "a haunted library",
    "a river",
    "a chess game",
    "a lighthouse keeper",
    "a snowstorm",
    "an old violin",
    "a desert caravan",
    "a clockmaker",
]


def copy_prompt(i: int) -> list[dict]:
    """A passage of five sentences (a different choice and order for each i) to repeat."""
    picked = [SENTENCES[(i * 3 + j * 5) % len(SENTENCES)] for j in range(5)]
    return [{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n" + " ".join(picked)}]


def open_prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}]


WORKLOADS = {"copy": copy_prompt, "open": open_prompt}


def run(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]], tuple[int, int, int]]:
    """Seconds to generate, the outputs, and the engine's (verify steps, drafts, accepted) of the run."""
    stats = llm.engine.stats
    before = (stats.speculative_steps, stats.draft_tokens, stats.accepted_tokens)
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = (stats.speculative_steps, stats.draft_tokens, stats.accepted_tokens)
    return seconds, [o.outputs[0].token_ids for o in outs], tuple(a - b for a, b in zip(after, before))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a registry name, or tiny-random")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    batch = max(args.batches)
    engine = dict(
        max_num_seqs=batch,
        max_num_batched_tokens=512,
        max_model_len=512,
        block_size=16,
        num_blocks=2 * batch * 512 // 16,
        decode_batch_buckets=tuple(sorted(set(args.batches))),
        prefill_token_buckets=(512,),
        prefill_seq_buckets=(4,),
        block_table_buckets=(32,),
        compilation_cache_dir=str(cache_dir() / "xla"),
    )  # the two engines share compiled steps
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    model = build_tiny_random() if args.model == "tiny-random" else load_model(args.model)
    llms = {"plain": LLM(model, **engine), "spec": LLM(model, speculative_config=spec, **engine)}
    tok = llms["plain"].get_tokenizer()
    print(
        f"model {args.model}, {args.tokens} new tokens (greedy), median of {args.rounds} rounds; "
        f"speculative_config {spec}"
    )
    for name in args.workloads:
        for b in args.batches:
            prompts = [
                tok.encode(tok.apply_chat_template(WORKLOADS[name](i), add_generation_prompt=True)) for i in range(b)
            ]
            print(f"  {name:4s} batch {b:3d}: " + _compare(llms, prompts, args.tokens, args.rounds))


def _compare(llms: dict[str, LLM], prompts: list[list[int]], tokens: int, rounds: int) -> str:
    """Plain against speculative decoding on the same prompts: a line of rates, acceptance and
    whether the greedy outputs are identical."""
    for llm in llms.values():
        run(llm, prompts[:1], 4)  # first steps of each kind, not timed
    times: dict[str, list[float]] = {k: [] for k in llms}
    outputs, counts = {}, (0, 0, 0)
    for _ in range(rounds):
        for key, llm in llms.items():
            seconds, outputs[key], c = run(llm, prompts, tokens)
            times[key].append(seconds)
            if key == "spec":
                counts = tuple(x + y for x, y in zip(counts, c))
    generated = sum(len(o) for o in outputs["plain"])
    same = outputs["plain"] == outputs["spec"]
    rate = {k: generated / statistics.median(v) for k, v in times.items()}
    steps, drafts, accepted = counts
    acceptance = f"{accepted / drafts:.2f}" if drafts else "n/a"
    per_step = f"{accepted / steps:.2f}" if steps else "n/a"
    return (
        f"plain {rate['plain']:7.1f} tok/s, spec {rate['spec']:7.1f} tok/s, "
        f"ratio {rate['spec'] / rate['plain']:.2f}x; acceptance {acceptance} ({accepted}/{drafts} drafts, "
        f"+{per_step} tokens per verify step, {steps} verify steps); {generated} tokens; "
        f"greedy outputs {'identical' if same else 'DIFFER'}"
    )


if __name__ == "__main__":
    main()
