"""Draft-model speculative decoding against plain decoding, measured in the same run, with its cost model.

Three engines serve one target: one without a draft, one with `--speculative-config '{"model": DRAFT,
"num_speculative_tokens": k, "adaptive_draft_length": false}'` (k pinned: "fixed") and one with the draft length
adapted (the default: "adaptive", `jaxserve.speculative.draft_length`). For each concurrency c the same greedy
code prompts run c at a time through each (offline `LLM.generate`), and the bench prints output tokens/s of each
and their ratio to plain, the acceptance rate (in all and per draft position), the mean accepted tokens per
draft and the mean draft length chosen per decode step, and for the fixed engine the cost model's terms: a
drafting step's time (k draft tokens, catch-up included) and a verify step's time, each over a plain decode
step's time. Greedy outputs are checked to be identical.

    PYTHONPATH=. python -m bench.draft_model [--target qwen2.5-coder-1.5b-instruct]
        [--draft qwen2.5-coder-0.5b-instruct] [--concurrency 1 4] [--tokens 128] [--k 4]
        [--dtype float32] [--quantization gguf] [--draft-quantization q4] [--modes fixed adaptive]

Cost model (per verify step, concurrency 1): plain decoding emits 1 token per target step T; speculation emits
1 + a tokens (a: mean accepted drafts) per D + V (D: drafting k tokens, V: the verify step), so the gain is
(1 + a) T / (D + V).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

from checkpoints.registry import load_model
from jaxserve import LLM, SamplingParams
from jaxserve.engine_snapshot import EngineSnapshot
from jaxserve.tokenizer import Tokenizer

MODES = ("fixed", "adaptive")  # the speculative engines: k pinned, k adapted

CODE_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function is_prime(n) that checks whether n is a prime number.",
    "Write a Python function that reverses a singly linked list, with the Node class.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "Write a Python function that counts the words in a text file and returns a dict.",
]


def run(llm: LLM, prompts: list[list[int]], concurrency: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to generate every prompt, `concurrency` at a time, and the outputs."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outputs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        group = [{"prompt_token_ids": p} for p in prompts[i : i + concurrency]]
        outputs += [o.outputs[0].token_ids for o in llm.generate(group, params, use_tqdm=False)]
    return time.perf_counter() - t0, outputs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument(
        "--draft-quantization", default="q4", help="the draft's own (its GGUF's Q5_0 kernels are not kept as stored)"
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="speculative engines run")
    args = parser.parse_args(argv)
    batch = max(args.concurrency)
    engine = dict(
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=batch,
        max_num_batched_tokens=256,
        max_model_len=512,
        block_size=16,
        num_blocks=batch * 512 // 16 + 8,
        decode_batch_buckets=tuple(sorted(set(args.concurrency))),
        prefill_token_buckets=(64, 256),
        block_table_buckets=(32,),
    )
    spec = {
        "model": args.draft,
        "num_speculative_tokens": args.k,
        "disable_by_batch_size": batch,
        "quantization": args.draft_quantization,
    }
    target = load_model(args.target, dtype=args.dtype, gguf_blocks=args.quantization == "gguf")
    tok = Tokenizer(target.tokenizer_bundle)
    chat = [[{"role": "user", "content": p}] for p in CODE_PROMPTS]
    prompts = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in chat]
    print(
        f"target {args.target} ({args.quantization}), draft {args.draft} ({args.draft_quantization}), k {args.k}, "
        f"{len(prompts)} code prompts, {args.tokens} tokens, greedy, one run"
    )
    # One engine at a time (two 1.5B engines and a draft each do not fit beside other work in 24 GiB): each runs
    # every concurrency, then is dropped.
    runs: dict[tuple[str, int], Run] = {}
    for mode in ("plain", *args.modes):
        speculative = {"speculative_config": {**spec, "adaptive_draft_length": mode == "adaptive"}}
        llm = LLM(target, **engine, **({} if mode == "plain" else speculative))
        for c in args.concurrency:
            runs[mode, c] = Run.of(llm, prompts, c, args.tokens)
        del llm
        gc.collect()
    for c in args.concurrency:
        print(f"  concurrency {c}:")
        for line in _compare({m: runs[m, k] for m, k in runs if k == c}, c):
            print(f"    {line}")


@dataclasses.dataclass
class Run:
    """One engine's run of the prompts at one concurrency: its time, outputs, and its counters' increments."""

    seconds: float
    outputs: list[list[int]]
    before: EngineSnapshot
    after: EngineSnapshot
    drafting_calls: int  # the proposer's drafting steps

    @classmethod
    def of(cls, llm: LLM, prompts: list[list[int]], concurrency: int, tokens: int) -> Run:
        proposer = llm.engine.proposer
        before, calls = llm.engine.snapshot(), proposer.stats.steps if proposer is not None else 0
        seconds, outputs = run(llm, prompts, concurrency, tokens)
        after = llm.engine.snapshot()
        return cls(seconds, outputs, before, after, (proposer.stats.steps if proposer is not None else 0) - calls)


def _compare(runs: dict[str, Run], concurrency: int) -> list[str]:
    """A line for the plain engine, and per speculative engine: rates, acceptance, draft lengths and (fixed k) the
    cost model's terms."""
    plain = runs["plain"]
    generated = sum(len(o) for o in plain.outputs)
    rate = {k: generated / r.seconds for k, r in runs.items()}
    target_step = plain.seconds / (generated / concurrency)  # a plain decode step (prefill included)
    lines = [f"plain {rate['plain']:.1f} tok/s (T = plain step {target_step:.3f} s)"]
    for key, r in runs.items():
        if key == "plain":
            continue
        b, a = r.before, r.after
        drafts = a.num_drafts - b.num_drafts
        drafted, accepted = a.draft_tokens - b.draft_tokens, a.accepted_tokens - b.accepted_tokens
        per_position = [
            f"{(a1 - a0) / (n1 - n0):.2f}" if n1 > n0 else "n/a"
            for n0, a0, n1, a1 in zip(b.position_drafts, b.position_accepted, a.position_drafts, a.position_accepted)
        ]
        steps = a.speculative_steps - b.speculative_steps
        draft_s = a.draft_seconds - b.draft_seconds
        decode_steps = a.draft_length_steps - b.draft_length_steps
        mean_length = (a.chosen_draft_tokens - b.chosen_draft_tokens) / max(decode_steps, 1)
        line = (
            f"{key}: {rate[key]:.1f} tok/s, ratio {rate[key] / rate['plain']:.2f}x; "
            f"acceptance {accepted / max(drafted, 1):.2f} ({accepted}/{drafted}; by position "
            f"{', '.join(per_position)}), mean accepted {accepted / max(drafts, 1):.2f} per draft; mean draft "
            f"length {mean_length:.2f} ({steps} of {decode_steps} decode steps drafted)"
        )
        if key == "fixed":
            drafting_step = draft_s / max(r.drafting_calls, 1)
            verify_step = (r.seconds - draft_s) / max(steps, 1)
            line += (
                f"; drafting step {drafting_step / target_step:.2f} T, verify step {verify_step / target_step:.2f} T"
            )
        same = r.outputs == plain.outputs
        lines.append(line + f"; greedy outputs {'identical' if same else 'DIFFER'}")
    return lines


if __name__ == "__main__":
    main()
