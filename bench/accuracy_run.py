"""`jaxserve bench accuracy`: an f32 reference engine and each candidate engine, built from
engine flags, score the same real text's tokens one after the other (one engine alive at a
time); the table compares each candidate with the reference (bench/accuracy.py)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import shlex
from typing import Any

from bench.accuracy import candidate_row, compare, engine_footprint, reference_row, score_text
from bench.heldout_text import first_tokens
from jaxserve.engine_args import add_engine_args, engine_config_from_args


def engine_namespace(base: argparse.Namespace, extra: str) -> argparse.Namespace:
    """`base`'s engine flags with those in `extra` (engine-flag text, e.g. "--dtype bfloat16")
    applied on top, through the same parser as every command's engine flags."""
    parser = argparse.ArgumentParser(prog="engine args", add_help=False)
    add_engine_args(parser)
    return parser.parse_args(shlex.split(extra), namespace=copy.copy(base))


def build_llm(ns: argparse.Namespace) -> Any:
    from jaxserve import LLM

    return LLM(ns.model, **dataclasses.asdict(engine_config_from_args(ns)))


def run_accuracy(
    base: argparse.Namespace,
    reference_args: str,
    candidate_args: list[str],
    text: str,
    positions: int,
    window: int | None = None,
) -> dict[str, Any]:
    """Score the first `positions` next-token positions of `text` with the reference engine and
    each candidate; returns {"positions", "rows"} (the reference's row first)."""
    ref_ns = engine_namespace(base, reference_args)
    llm = build_llm(ref_ns)
    ids = first_tokens(llm.get_tokenizer(), text, positions + 1)
    if len(ids) < positions + 1:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --positions {positions} + 1")
    reference = score_text(llm, ids, window)
    rows = [reference_row(reference_args or "reference", reference, engine_footprint(llm))]
    del llm
    gc.collect()
    for extra in candidate_args:
        llm = build_llm(engine_namespace(base, extra))
        rows.append(candidate_row(extra, compare(reference, score_text(llm, ids, window)), engine_footprint(llm)))
        del llm
        gc.collect()
    return {"positions": reference.num_positions, "rows": rows}
