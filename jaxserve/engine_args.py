"""Engine flags for every command line (`jaxserve serve`, `chat`, `generate`, `bench ...`).

They are generated from `EngineConfig`'s fields (`--max-num-seqs`, `--dtype`, ...), so every
engine setting has exactly one flag with the same name as the Python argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from checkpoints.registry import DEFAULT_MODEL, cache_dir
from jaxserve.config import QUANTIZATIONS, EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf file, HF or Orbax directory")
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="split the CPU into this many JAX devices (try --tensor-parallel-size and "
        "--data-parallel-size without accelerators)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve from the start, by model name "
        "(needs --enable-lora; more can be loaded at run time: POST /v1/load_lora_adapter)",
    )
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        if f.name == "speculative_config":
            group.add_argument(
                flag,
                default=None,
                metavar="JSON",
                help='n-gram speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\'',
            )
        elif hint is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif "tuple" in str(hint):
            group.add_argument(flag, type=int, nargs="+", default=None, help="shape buckets")
        else:
            base = int if "int" in str(hint) else float if "float" in str(hint) else str
            default = f.default
            if f.name == "compilation_cache_dir":  # restarts of the CLI reuse compiled steps
                default = str(cache_dir() / "xla")
            if f.name == "dtype":  # the command line picks the faster dtype of this machine
                group.add_argument(
                    flag,
                    default="auto",
                    choices=("auto", "float32", "bfloat16"),
                    help="the weights' dtype; auto: bfloat16 on a CPU with AVX512-BF16 and the C++ "
                    "kernels, else float32 (jaxserve/dtype_choice.py; logged at start)",
                )
                continue
            if f.name == "quantization":
                group.add_argument(
                    flag,
                    default=default,
                    choices=QUANTIZATIONS,
                    help="weight-only quantization of the layers' matmuls and the output head: int8 per "
                    "output channel, q4 (4 bits, groups of 32; the head int8), gguf (a .gguf "
                    "file's Q8_0/Q4_0/Q4_1/Q4_K blocks as stored); checkpoints/quantize.py",
                )
                continue
            if f.name == "kv_cache_dtype":  # checked by kernels_pallas.kv_quant when the engine starts
                group.add_argument(
                    flag,
                    default=default,
                    help="auto (the weights' dtype: bf16 weights keep a bf16 cache), float32, bfloat16, fp8 "
                    "(= fp8_e4m3) or int8; fp8 and int8 store a scale per token and kv head",
                )
                continue
            group.add_argument(flag, type=base, default=default)


def lora_modules_from_args(args: argparse.Namespace) -> dict[str, str]:
    """`--lora-modules NAME=PATH ...` as {name: path}; SystemExit for a malformed entry."""
    modules: dict[str, str] = {}
    for entry in getattr(args, "lora_modules", []):
        name, sep, path = entry.partition("=")
        if not sep or not name or not path or name in modules:
            raise SystemExit(f"--lora-modules takes distinct NAME=PATH entries, got {entry!r}")
        modules[name] = path
    if modules and not args.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    return modules


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
