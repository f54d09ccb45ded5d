"""The `jaxserve` command line: the composition root (imports server and bench lazily). The
engine flags of every command come from `jaxserve.engine_args`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxserve.engine_args import add_engine_args, engine_config_from_args, lora_modules_from_args

PACKAGES = ("jaxserve", "server", "bench", "checkpoints", "sharding", "kernels_pallas")


def _cmd_chat(args: argparse.Namespace) -> int:
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM(args.model, **dataclasses.asdict(engine_config_from_args(args)))
    messages = [{"role": "user", "content": args.message}]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    t0 = time.perf_counter()
    out = llm.chat(messages, params, use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    print(out.outputs[0].text)
    n = len(out.outputs[0].token_ids)
    print(f"[{n} tokens in {dt:.2f} s; warm-up {llm.warm_up_seconds:.1f} s]", file=sys.stderr)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from jaxserve.generate_jsonl import run
    from jaxserve.llm import LLM

    llm = LLM(args.model, **dataclasses.asdict(engine_config_from_args(args)))
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    counts = run(llm, Path(args.input), Path(args.output), defaults)
    print(json.dumps(counts))
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from checkpoints.registry import convert

    convert(args.src, args.dst)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM serving on JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("chat", help="one chat reply from the command line")
    p.add_argument("message")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(p)
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("generate", help="offline batch generation, JSONL in and out")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--max-tokens", type=int, default=128, help="default for lines that set none")
    p.add_argument("--temperature", type=float, default=0.0, help="default for lines that set none")
    add_engine_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("convert", help="convert a checkpoint to a fast-loading Orbax directory")
    p.add_argument("src")
    p.add_argument("dst")
    p.set_defaults(func=_cmd_convert)

    # The server and the benchmarks live above jaxserve in the layering: imported here only.
    from bench.cli import add_bench_parser
    from server.cli import add_serve_parser
    from server.cluster.launch.cli import add_launch_parser
    from server.cluster.pool_tls import add_gateway_parser
    from server.cluster.router.cli import add_router_parser
    from server.cluster.worker.cli import add_worker_parser

    add_serve_parser(sub, add_engine_args, _serve_command)
    add_worker_parser(sub, add_engine_args, _engine_starter)
    add_router_parser(sub)
    add_launch_parser(sub)
    add_gateway_parser(sub)
    add_bench_parser(sub)
    return parser


def _engine_starter(args: argparse.Namespace) -> Callable[..., Any]:
    """What `serve` and `worker` call to start the engine their flags describe (`jaxserve.serving`)."""

    def start(**kwargs: Any) -> Any:
        from jaxserve.serving import start_engine

        return start_engine(
            args.model, engine_config_from_args(args), lora_modules=lora_modules_from_args(args), **kwargs
        )

    return start


def _serve_command(args: argparse.Namespace) -> int:
    """`jaxserve serve`: one engine behind the server, or, with data-parallel replicas on several
    processes, each replica group's engine behind process 0's router (server/cluster/replica_groups.py)."""
    import jax

    if args.data_parallel_size > 1 and jax.process_count() > 1:
        from server.cluster.replica_groups import serve_replica_groups

        return serve_replica_groups(args, _engine_starter(args))
    from server.cli import serve

    return serve(args, _engine_starter(args))


def _prepare_jax(args: argparse.Namespace) -> None:
    """Settings JAX reads once, when its backends start: applied before a command touches JAX."""
    if getattr(args, "cpu_devices", None) is not None:
        import jax

        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if hasattr(args, "coordinator_address"):  # commands that can run across processes
        from sharding import multihost

        multihost.initialize(
            args.coordinator_address,
            args.num_processes,
            args.process_id,
            independent_groups=getattr(args, "data_parallel_size", 1) > 1,
        )


def main(argv: list[str] | None = None) -> int:
    # force: an import may already have configured the root logger. INFO from our packages
    # only (libraries such as orbax log their I/O at INFO).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for package in PACKAGES:
        logging.getLogger(package).setLevel(logging.INFO)
    args = build_parser().parse_args(argv)
    _prepare_jax(args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
