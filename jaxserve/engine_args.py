"""Engine flags for every command line (`jaxserve serve`, `chat`, `generate`, `bench ...`).

They are generated from `EngineConfig`'s fields (`--max-num-seqs`, `--dtype`, ...), so every
engine setting has exactly one flag with the same name as the Python argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from checkpoints.registry import DEFAULT_MODEL, cache_dir
from jaxserve.config import QUANTIZATIONS, EngineConfig
from jaxserve.speculative.config import SpeculativeConfig


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
        group.add_argument("--" + f.name.replace("_", "-"), **_flag_options(f, hints[f.name]))


def _flag_options(field: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """`add_argument`'s options for an `EngineConfig` field: its own (`_SPECIAL_FLAGS`), or by its type."""
    if field.name in _SPECIAL_FLAGS:
        return {"default": field.default, **_SPECIAL_FLAGS[field.name]}
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction, "default": field.default}
    if "tuple" in str(hint):
        return {"type": int, "nargs": "+", "default": None, "help": "shape buckets"}
    base = int if "int" in str(hint) else float if "float" in str(hint) else str
    default = field.default
    if field.name == "compilation_cache_dir":  # restarts of the CLI reuse compiled steps
        default = str(cache_dir() / "xla")
    return {"type": base, "default": default}


def _speculative_config(text: str) -> SpeculativeConfig | None:
    """`--speculative-config JSON`, read when the flags are parsed: a bad one is a usage error naming the flag."""
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Flags with their own parsing, choices, help or command-line default.
_SPECIAL_FLAGS: dict[str, dict[str, Any]] = {
    "speculative_config": dict(
        type=_speculative_config,
        metavar="JSON",
        help='speculative decoding, with vLLM\'s names, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\'',
    ),
    "dtype": dict(  # the command line picks the faster dtype of this machine
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="the weights' dtype; auto: bfloat16 on a CPU with AVX512-BF16 and the C++ "
        "kernels, else float32 (jaxserve/dtype_choice.py; logged at start)",
    ),
    "quantization": dict(  # the command line picks the faster mode of this machine, as for --dtype
        default="auto",
        choices=QUANTIZATIONS,
        help="weight-only quantization of the layers' matmuls and the output head: int8 per "
        "output channel, q4 (4 bits, groups of 32; the head int8), gguf (a .gguf "
        "file's Q8_0/Q5_0/Q4_0/Q4_1/Q4_K blocks as stored), none; auto: gguf for a GGUF file on the "
        "C++ CPU kernels, else none (jaxserve/quantization_choice.py; logged at start)",
    ),
    "kv_cache_dtype": dict(  # checked when the config is resolved (kernels_pallas.kv_quant)
        help="auto (the weights' dtype: bf16 weights keep a bf16 cache), float32, bfloat16, fp8 "
        "(= fp8_e4m3) or int8; fp8 and int8 store a scale per token and kv head",
    ),
}


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
    """The `EngineConfig` of the parsed flags (a bucket flag's list as a tuple)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{name: tuple(v) if isinstance(v, list) else v for name, v in values.items()})
