"""The flags `jaxserve bench` commands share (workload, peer, output, serving) and what they build."""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.metrics import DEFAULT_PERCENTILES, SLO
from bench.workloads import WORKLOAD_NAMES, TokenizerLike, TokenSampler, Workload

DEFAULT_RESULT_DIR = Path("out/bench")


def add_workload_args(p: argparse.ArgumentParser, default_prompt_format: str, add_seed: bool = True) -> None:
    """Workload flags; `add_seed=False` where the engine flags already define --seed (it then seeds both)."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", "--dataset-name", dest="workload", choices=WORKLOAD_NAMES, default="random")
    g.add_argument("--workload-file", "--dataset-path", dest="workload_file", help="JSONL file (--workload jsonl)")
    g.add_argument(
        "--num-prompts", type=int, default=100, help="requests (random, shared-prefix, long-prompt: short ones)"
    )
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128)
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=64)
    g.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0)
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per shared prefix")
    g.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: tokens per question")
    g.add_argument("--long-num", type=int, default=4, help="long-prompt: long prompts among --num-prompts short")
    g.add_argument("--long-len", type=int, default=1536, help="long-prompt: tokens per long prompt")
    g.add_argument("--short-len", type=int, default=64, help="long-prompt: tokens per short prompt")
    g.add_argument("--num-sessions", type=int, default=8, help="multi-turn: conversations")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    g.add_argument("--user-len", type=int, default=32, help="multi-turn: tokens per user message")
    g.add_argument("--system-len", type=int, default=0, help="multi-turn: tokens of the system prompt")
    g.add_argument("--max-images", type=int, default=4, help="images: 1 .. this many images per request")
    g.add_argument("--prompt-format", choices=("ids", "text"), default=default_prompt_format,
                   help="send prompts as token ids or as text (peers' servers take text)")  # fmt: skip
    if add_seed:
        g.add_argument("--seed", type=int, default=0)


def workload_factory(args: argparse.Namespace) -> Callable[[TokenizerLike, set[int], int], Workload]:
    """A function (tokenizer, special ids, seed offset) -> the workload the flags describe."""
    from bench import workloads as w

    def make(tokenizer: TokenizerLike, special: set[int], seed_offset: int = 0) -> Workload:
        sampler = TokenSampler(tokenizer, args.seed + seed_offset, special)
        text = args.prompt_format == "text"
        if args.workload == "random":
            return w.random_workload(sampler, args.num_prompts, args.input_len, args.output_len, args.range_ratio, text)
        if args.workload == "facts32":
            return w.facts32_workload(sampler, text)
        if args.workload == "shared-prefix":
            per_prefix = math.ceil(args.num_prompts / args.num_prefixes)
            return w.shared_prefix_workload(sampler, args.num_prefixes, per_prefix, args.prefix_len, args.suffix_len,
                                            args.output_len, text)  # fmt: skip
        if args.workload == "long-prompt":
            return w.long_prompt_workload(sampler, args.num_prompts, args.short_len, args.long_num, args.long_len,
                                          args.output_len, text)  # fmt: skip
        if args.workload == "multi-turn":
            return w.multi_turn_workload(sampler, args.num_sessions, args.turns, args.user_len, args.output_len,
                                         args.system_len)  # fmt: skip
        if args.workload == "images":
            from bench.image_workload import image_workload

            return image_workload(sampler, args.num_prompts, args.input_len, args.output_len, args.max_images)
        if not args.workload_file:
            raise SystemExit("--workload jsonl needs --workload-file")
        return w.jsonl_workload(args.workload_file, tokenizer, args.output_len)

    return make


def add_peer_args(p: argparse.ArgumentParser, choices: tuple[str, ...]) -> None:
    g = p.add_argument_group("peer (optional; measured in the same run on the same workload and GGUF)")
    g.add_argument("--peer", choices=choices, default=None)
    g.add_argument("--peer-python", default=None, help="interpreter that has the peer installed (default: this one)")
    g.add_argument("--peer-threads", type=int, default=2, help="CPU threads for the peer")


def add_output_args(p: argparse.ArgumentParser, ignore_eos_flag: bool = True) -> None:
    p.add_argument(
        "--result-file", default=None, help=f"JSON output (default: {DEFAULT_RESULT_DIR}/KIND-WORKLOAD-TIME.json)"
    )
    if ignore_eos_flag:
        p.add_argument(
            "--no-ignore-eos",
            dest="ignore_eos",
            action="store_false",
            help="let requests stop at EOS (default: exactly max_tokens each, as vLLM's random dataset)",
        )


def result_path(args: argparse.Namespace, kind: str, name: str) -> Path:
    if args.result_file:
        return Path(args.result_file)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return DEFAULT_RESULT_DIR / f"{kind}-{name.replace(':', '-')}-{stamp}.json"


def percentiles(text: str) -> tuple[float, ...]:
    values = tuple(float(x) for x in text.split(",") if x.strip())
    if not values or any(not 0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError("percentiles are numbers in (0, 100], comma-separated")
    return values


def add_serving_args(p: argparse.ArgumentParser) -> None:
    from checkpoints.registry import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="model spec (tokenizer, server model, peers' GGUF)")
    p.add_argument("--base-url", default=None, help="a running jaxserve server (default: start one on a free port)")
    p.add_argument("--served-model-name", default=None, help="`model` field of the requests (default: --model)")
    p.add_argument(
        "--server-args",
        default="",
        help="extra `jaxserve serve` flags when starting the server, one string; written with = "
        '(--server-args="--dtype bfloat16"), since it starts with a dash',
    )
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for a server to be ready")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-concurrency", type=int, default=None, help="closed loop: requests in flight at most")
    p.add_argument("--api", choices=("completions", "chat"), default="completions", help="for single-turn workloads")
    p.add_argument("--multi-turn-api", choices=("history", "sessions"), default="history",
                   help="multi-turn: resend the chat history, or use /v1/sessions")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--slo", type=SLO.parse, default=None, metavar="TTFT_MS,TPOT_MS", help="goodput SLO, e.g. 500,100")
    p.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", type=percentiles,
                   default=DEFAULT_PERCENTILES, help="besides mean and median; e.g. 90,99")  # fmt: skip
    p.add_argument("--plot", action="store_true", help="write PNGs next to the result file")
    p.add_argument("--save-detailed", action="store_true", help="keep every inter-token gap in the JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument(
        "--peer-n-ctx",
        type=int,
        default=4096,
        help="context of the llama-cpp server (llama-server: per slot; vllm: --max-model-len)",
    )
    p.add_argument("--peer-binary", default="llama-server", help="llama-server: the executable (path or name on PATH)")
    p.add_argument("--peer-slots", type=int, default=32, help="llama-server: parallel slots (continuous batching)")
    p.add_argument(
        "--peer-model",
        default=None,
        help="vllm: a Hugging Face model directory (default: the GGUF converted by transformers, cached)",
    )
    p.add_argument(
        "--peer-convert-python",
        default=None,
        help="vllm: interpreter with torch, transformers, accelerate and gguf that converts the GGUF "
        "(default: --peer-python)",
    )
    p.add_argument("--peer-dtype", choices=("float32", "bfloat16"), default="bfloat16", help="vllm: its --dtype")
    p.add_argument("--peer-kv-cache-gib", type=float, default=2.0, help="vllm: its KV cache (VLLM_CPU_KVCACHE_SPACE)")
    add_workload_args(p, "text")
    add_peer_args(p, ("llama-cpp", "llama-server", "vllm"))
    add_output_args(p)


def serve_options(args: argparse.Namespace) -> Any:
    from bench.serve import ServeOptions

    return ServeOptions(model=args.model, base_url=args.base_url, served_model_name=args.served_model_name,
                        server_args=shlex.split(args.server_args), startup_timeout_s=args.startup_timeout,
                        api_key=args.api_key, ignore_eos=args.ignore_eos, peer=args.peer,
                        peer_python=args.peer_python, peer_threads=args.peer_threads,
                        peer_n_ctx=args.peer_n_ctx, peer_binary=args.peer_binary,
                        peer_slots=args.peer_slots, peer_model=args.peer_model,
                        peer_convert_python=args.peer_convert_python, peer_dtype=args.peer_dtype,
                        peer_kv_cache_gib=args.peer_kv_cache_gib)  # fmt: skip


def load_spec(args: argparse.Namespace, rate: float, concurrency: int | None) -> Any:
    from bench.load import LoadSpec

    return LoadSpec(request_rate=rate, max_concurrency=concurrency, seed=args.seed, api=args.api,
                    multi_turn_api=args.multi_turn_api, request_timeout_s=args.request_timeout)  # fmt: skip


def workload_tokenizer(model: str) -> tuple[Any, set[int]]:
    from bench.model_files import load_tokenizer, special_token_ids

    tokenizer = load_tokenizer(model)
    return tokenizer, special_token_ids(tokenizer)
