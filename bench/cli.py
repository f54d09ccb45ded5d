"""`jaxserve bench {serve,sweep,throughput,latency,accuracy,compare}`; flags follow `vllm bench` where it has one.

`jaxserve/cli.py` calls `add_bench_parser(subparsers)`; each command sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

from bench.cli_flags import (
    DEFAULT_RESULT_DIR,
    add_output_args,
    add_peer_args,
    add_serving_args,
    add_workload_args,
    load_spec,
    result_path,
    serve_options,
    workload_factory,
    workload_tokenizer,
)
from jaxserve.engine_args import add_engine_args, engine_config_from_args


def _guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A missing peer or a server that does not come up is a clear message and exit code 2."""

    def wrapper(args: argparse.Namespace) -> int:
        from bench.peers.runner import PeerUnavailable
        from bench.server_process import ServerStartError

        try:
            return run(args)
        except (PeerUnavailable, ServerStartError) as e:
            print(f"jaxserve bench: {e}", file=sys.stderr)
            return 2

    return wrapper


# ----- commands ------------------------------------------------------------------------------


def _cmd_serve(args: argparse.Namespace) -> int:
    from bench.report import print_result, write_json
    from bench.serve import run_serve

    tokenizer, special = workload_tokenizer(args.model)
    workload = workload_factory(args)(tokenizer, special)
    path = result_path(args, "serve", workload.name)
    stem = str(path.with_suffix("")) if args.plot else None
    if stem:
        path.parent.mkdir(parents=True, exist_ok=True)
    result = run_serve(serve_options(args), workload, load_spec(args, args.request_rate, args.max_concurrency),
                       tokenizer, args.slo, args.percentiles, args.save_detailed, stem, args.progress)  # fmt: skip
    print_result(result)
    write_json(result, path)
    print(f"results: {path}" + (f"; plots: {', '.join(result['plots'])}" if "plots" in result else ""))
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from bench.report import write_json
    from bench.sweep import SweepPoint, print_sweep, run_sweep

    if (args.request_rates is None) == (args.concurrencies is None):
        raise SystemExit("give exactly one of --request-rates or --concurrencies")
    if args.request_rates is not None:
        xlabel = "request_rate"
        points = [SweepPoint(r, load_spec(args, r, args.max_concurrency)) for r in args.request_rates]
    else:
        xlabel = "max_concurrency"
        points = [SweepPoint(c, load_spec(args, math.inf, c)) for c in args.concurrencies]
    tokenizer, special = workload_tokenizer(args.model)
    make = workload_factory(args)
    path = result_path(args, "sweep", args.workload)
    stem = str(path.with_suffix("")) if args.plot else None
    if stem:
        path.parent.mkdir(parents=True, exist_ok=True)
    result = run_sweep(serve_options(args), lambda i: make(tokenizer, special, i), points, xlabel, tokenizer,
                       args.slo, args.slo_attainment, args.percentiles, stem, args.progress)  # fmt: skip
    print_sweep(result, _SWEEP_KEYS)
    write_json(result, path)
    print(f"results: {path}" + (f"; plots: {', '.join(result['plots'])}" if "plots" in result else ""))
    return 0


_SWEEP_KEYS = [
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "request_goodput",
    "slo_attainment",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
]


def _engine_args(args: argparse.Namespace) -> dict[str, Any]:

    return dataclasses.asdict(engine_config_from_args(args))


def _peer_spec(args: argparse.Namespace) -> Any:
    from bench.model_files import gguf_path
    from bench.offline import PeerSpec
    from bench.peers.runner import PeerUnavailable, check_peer

    if args.peer is None:
        return None
    check_peer(args.peer, args.peer_python)  # fail before the long jaxserve part, not after it
    try:
        gguf_path(args.model)
    except ValueError as e:
        raise PeerUnavailable(str(e)) from e
    return PeerSpec(
        args.peer,
        args.peer_python,
        args.peer_threads,
        getattr(args, "peer_batch_size", 32),
        getattr(args, "peer_dtype", "float32"),
    )


def _cmd_throughput(args: argparse.Namespace) -> int:
    from bench.offline import run_throughput
    from bench.report import print_result, write_json

    peer = _peer_spec(args)
    make = workload_factory(args)
    result = run_throughput(args.model, _engine_args(args), lambda tok, special: make(tok, special, 0), peer,
                            args.ignore_eos, args.progress)  # fmt: skip
    print_result(result)
    path = result_path(args, "throughput", result["workload"]["name"])
    write_json(result, path)
    print(f"results: {path}")
    return 0


def _cmd_latency(args: argparse.Namespace) -> int:
    from bench.offline import run_latency
    from bench.report import print_result, write_json

    result = run_latency(args.model, _engine_args(args), args.input_len, args.output_len, args.num_iters,
                         args.num_iters_warmup, args.seed, _peer_spec(args))  # fmt: skip
    print_result(result)
    path = result_path(args, "latency", "single")
    write_json(result, path)
    print(f"results: {path}")
    return 0


def _cmd_accuracy(args: argparse.Namespace) -> int:
    from bench.accuracy import format_table
    from bench.accuracy_run import run_accuracy
    from bench.heldout_text import load_text
    from bench.report import write_json
    from bench.system_info import system_info

    text, source = load_text(args.text_file)
    result = run_accuracy(args, args.reference_args, args.candidate_args or [], text, args.positions, args.window)
    result = {"system": system_info(), "model": args.model, "text": source, **result}
    print(f"{args.model}: {result['positions']} next-token positions of {source}")
    print(format_table(result["rows"]))
    path = result_path(args, "accuracy", "text")
    write_json(result, path)
    print(f"results: {path}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from bench.report import compare

    print(compare(args.a, args.b))
    return 0


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` and its commands to the `jaxserve` command's subparsers."""

    bench = subparsers.add_parser("bench", help="serving and offline benchmarks, with peers")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_serve_command(sub)
    _add_sweep_command(sub)
    _add_throughput_command(sub)
    _add_latency_command(sub)
    _add_accuracy_command(sub)
    _add_compare_command(sub)
    return bench


def _add_serve_command(sub: Any) -> None:
    p = sub.add_parser("serve", help="load a server over HTTP and measure TTFT, TPOT, ITL, throughput, goodput")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf)")
    add_serving_args(p)
    p.set_defaults(func=_guarded(_cmd_serve))


def _add_sweep_command(sub: Any) -> None:
    p = sub.add_parser("sweep", help="several request rates or concurrencies -> latency-throughput curve")
    p.add_argument("--request-rates", type=float, nargs="+", default=None)
    p.add_argument("--concurrencies", type=int, nargs="+", default=None)
    p.add_argument("--slo-attainment", type=float, default=0.9,
                   help="a point meets the SLO when this fraction of its requests does")  # fmt: skip
    add_serving_args(p)
    p.set_defaults(func=_guarded(_cmd_sweep))


def _add_throughput_command(sub: Any) -> None:
    p = sub.add_parser("throughput", help="offline engine throughput on a workload (no HTTP)")
    add_engine_args(p)
    add_workload_args(p, "ids", add_seed=False)
    add_peer_args(p, ("transformers", "llama-cpp"))
    p.add_argument("--peer-batch-size", type=int, default=32, help="transformers: prompts per generate() batch")
    p.add_argument(
        "--peer-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="transformers: compute dtype (torch's bf16 matmuls are fast on AVX512-BF16 CPUs)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false")
    add_output_args(p)
    p.set_defaults(func=_guarded(_cmd_throughput))


def _add_latency_command(sub: Any) -> None:
    p = sub.add_parser("latency", help="one request: prefill time and per-token decode time")
    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    add_peer_args(p, ("transformers", "llama-cpp"))
    add_output_args(p, ignore_eos_flag=False)
    p.set_defaults(func=_guarded(_cmd_latency))


def _add_accuracy_command(sub: Any) -> None:
    p = sub.add_parser("accuracy", help="top-1 agreement and perplexity of engine modes against an f32 reference")
    add_engine_args(p)
    p.add_argument("--positions", type=int, default=2000, help="next-token positions of the text to score")
    p.add_argument(
        "--reference-args",
        default="--dtype float32 --quantization none",
        help="engine flags of the reference, on top of the shared ones (one string; the default: the "
        "checkpoint's weights in f32, whatever --quantization auto would pick)",
    )
    p.add_argument(
        "--candidate-args",
        action="append",
        default=None,
        help="engine flags of a candidate, one string, written with = "
        "(--candidate-args='--dtype bfloat16'); repeat for several",
    )
    p.add_argument(
        "--text-file",
        default=None,
        help="UTF-8 text to score (default: the Python documentation's help topics, bench/heldout_text.py)",
    )
    p.add_argument("--window", type=int, default=None, help="tokens per scored window (default: max_model_len - 1)")
    p.add_argument(
        "--result-file", default=None, help=f"JSON output (default: {DEFAULT_RESULT_DIR}/accuracy-text-TIME.json)"
    )
    p.set_defaults(func=_cmd_accuracy)


def _add_compare_command(sub: Any) -> None:
    p = sub.add_parser("compare", help="compare two result JSON files")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(func=_cmd_compare)
