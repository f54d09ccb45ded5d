"""Benchmark workloads: what to send, built deterministically from a seed.

A workload is a list of items; an item is either a `BenchRequest` (one completion: a prompt as
token ids or text and an output length) or a `Conversation` (several user turns, each sent after
the previous reply arrived). Named workloads:

- `random`: prompts of random tokens, input / output lengths uniform in len * [1 - r, 1 + r]
  (vLLM's `--random-range-ratio`);
- `facts32`: the 32-prompt workload of shared/FACTS.md (32 prompts of 16..256 tokens, 64 new
  tokens each), the one the transformers and llama.cpp figures there were measured on;
- `shared-prefix`: N system prompts, each shared by many questions, sent in shuffled order;
- `long-prompt`: a few long prompts spread among many short ones (head-of-line blocking);
- `multi-turn`: conversations of several turns, through the sessions API or plain chat history;
- a JSONL file: one item per line, `{"prompt": str | [ids], "max_tokens": n, "group": label}`
  or `{"turns": [str, ...], "system": str, "max_tokens": n}`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class TokenizerLike(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


@dataclasses.dataclass
class BenchRequest:
    prompt: str | list[int]  # token ids, or text
    max_tokens: int
    prompt_len: int  # of its text (an image's tokens are the model's to count)
    group: str = ""
    images: tuple[bytes, ...] = ()  # encoded images sent before the text (bench/image_workload.py)

    def token_ids(self, tokenizer: TokenizerLike) -> list[int]:
        return self.prompt if isinstance(self.prompt, list) else tokenizer.encode(self.prompt)


@dataclasses.dataclass
class Conversation:
    turns: list[str]  # the user's messages, in order
    max_tokens: int  # per reply
    system: str | None = None
    group: str = ""


WorkItem = BenchRequest | Conversation


@dataclasses.dataclass
class Workload:
    name: str
    items: list[WorkItem]
    params: dict[str, Any]  # how it was built, recorded in the result JSON

    @property
    def is_multi_turn(self) -> bool:
        return any(isinstance(i, Conversation) for i in self.items)

    @property
    def requests(self) -> list[BenchRequest]:
        """The single-turn items; offline benchmarks accept only these."""
        if self.is_multi_turn:
            raise ValueError(f"workload {self.name!r} has conversations; it can only be served (bench serve)")
        return [i for i in self.items if isinstance(i, BenchRequest)]

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "params": self.params, "num_items": len(self.items)}
        if not self.is_multi_turn:
            out["total_prompt_tokens"] = sum(r.prompt_len for r in self.requests)
            out["total_max_tokens"] = sum(r.max_tokens for r in self.requests)
        return out


class TokenSampler:
    """Random ordinary (non-special) token ids, and text made from them."""

    def __init__(self, tokenizer: TokenizerLike, seed: int, special_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        special = set(special_ids)
        self.ordinary = np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64)

    def ids(self, n: int) -> list[int]:
        return [int(i) for i in self.rng.choice(self.ordinary, size=n)]

    def text(self, n: int) -> str:
        return self.tokenizer.decode(self.ids(n))

    def lengths(self, mean: int, range_ratio: float, count: int) -> list[int]:
        lo = max(1, int(round(mean * (1 - range_ratio))))
        hi = max(lo, int(round(mean * (1 + range_ratio))))
        return [int(x) for x in self.rng.integers(lo, hi + 1, size=count)]


def _request(sampler: TokenSampler, ids: list[int], max_tokens: int, as_text: bool, group: str = "") -> BenchRequest:
    if not as_text:
        return BenchRequest(ids, max_tokens, len(ids), group)
    text = sampler.tokenizer.decode(ids)
    return BenchRequest(text, max_tokens, len(sampler.tokenizer.encode(text)), group)


def random_workload(sampler: TokenSampler, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, as_text: bool = False) -> Workload:  # fmt: skip
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range_ratio must be in [0, 1)")
    ins = sampler.lengths(input_len, range_ratio, num_prompts)
    outs = sampler.lengths(output_len, range_ratio, num_prompts)
    items: list[WorkItem] = [_request(sampler, sampler.ids(i), o, as_text) for i, o in zip(ins, outs)]
    params = {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "range_ratio": range_ratio}
    return Workload("random", items, params)


FACTS32_NUM_PROMPTS = 32
FACTS32_MIN_LEN, FACTS32_MAX_LEN = 16, 256
FACTS32_OUTPUT_LEN = 64


def facts32_workload(sampler: TokenSampler, as_text: bool = False) -> Workload:
    """32 prompts with lengths evenly spaced over 16..256 tokens (4,352 in all), 64 new tokens each."""
    lengths = np.linspace(FACTS32_MIN_LEN, FACTS32_MAX_LEN, FACTS32_NUM_PROMPTS).round().astype(int)
    items: list[WorkItem] = [_request(sampler, sampler.ids(int(n)), FACTS32_OUTPUT_LEN, as_text) for n in lengths]
    return Workload("facts32", items, {"num_prompts": 32, "input_lens": "16..256", "output_len": 64})


def shared_prefix_workload(sampler: TokenSampler, num_prefixes: int, questions_per_prefix: int, prefix_len: int,
                           question_len: int, output_len: int, as_text: bool = False) -> Workload:  # fmt: skip
    prefixes = [sampler.ids(prefix_len) for _ in range(num_prefixes)]
    items: list[WorkItem] = [
        _request(sampler, prefixes[p] + sampler.ids(question_len), output_len, as_text, f"prefix-{p}")
        for p in range(num_prefixes)
        for _ in range(questions_per_prefix)
    ]
    order = sampler.rng.permutation(len(items))
    params = {"num_prefixes": num_prefixes, "questions_per_prefix": questions_per_prefix, "prefix_len": prefix_len,
              "question_len": question_len, "output_len": output_len}  # fmt: skip
    return Workload("shared-prefix", [items[i] for i in order], params)


def long_prompt_workload(sampler: TokenSampler, num_short: int, short_len: int, num_long: int, long_len: int,
                         output_len: int, as_text: bool = False) -> Workload:  # fmt: skip
    """Short requests with `num_long` long ones placed evenly among them (groups `short` / `long`)."""
    items: list[WorkItem] = [
        _request(sampler, sampler.ids(short_len), output_len, as_text, "short") for _ in range(num_short)
    ]
    total = num_short + num_long
    for k in range(num_long):
        position = int((k + 0.5) * total / num_long)
        items.insert(min(position, len(items)), _request(sampler, sampler.ids(long_len), output_len, as_text, "long"))
    params = {"num_short": num_short, "short_len": short_len, "num_long": num_long, "long_len": long_len,
              "output_len": output_len}  # fmt: skip
    return Workload("long-prompt", items, params)


def multi_turn_workload(sampler: TokenSampler, num_sessions: int, turns: int, user_len: int, output_len: int,
                        system_len: int = 0) -> Workload:  # fmt: skip
    items: list[WorkItem] = [
        Conversation(
            turns=[sampler.text(user_len) for _ in range(turns)],
            max_tokens=output_len,
            system=sampler.text(system_len) if system_len else None,
        )
        for _ in range(num_sessions)
    ]
    params = {"num_sessions": num_sessions, "turns": turns, "user_len": user_len, "output_len": output_len,
              "system_len": system_len}  # fmt: skip
    return Workload("multi-turn", items, params)


def jsonl_workload(path: str | Path, tokenizer: TokenizerLike, default_max_tokens: int = 128) -> Workload:
    items: list[WorkItem] = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(_jsonl_item(json.loads(line), tokenizer, default_max_tokens))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}:{number}: {e}") from e
    if not items:
        raise ValueError(f"{path}: no workload lines")
    return Workload(f"jsonl:{Path(path).name}", items, {"path": str(path)})


def _jsonl_item(obj: Any, tokenizer: TokenizerLike, default_max_tokens: int) -> WorkItem:
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    max_tokens = int(obj.get("max_tokens", obj.get("output_len", default_max_tokens)))
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    group = str(obj.get("group", ""))
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError("'turns' must be a non-empty list of strings")
        return Conversation(turns, max_tokens, obj.get("system"), group)
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        return BenchRequest(prompt, max_tokens, len(tokenizer.encode(prompt)), group)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return BenchRequest(prompt, max_tokens, len(prompt), group)
    raise ValueError("'prompt' must be a string or a non-empty list of token ids")


WORKLOAD_NAMES = ("random", "facts32", "shared-prefix", "long-prompt", "multi-turn", "images", "jsonl")
