"""Make tests/data/smollm2_reference.json: Hugging Face transformers' behaviour on the default model.

Run with the reference venv (torch + transformers + gguf; not a jaxserve dependency):

    /work/refvenv/bin/python tests/data/make_reference.py [--gguf PATH]

PATH defaults to the registry's cached copy, `$JAXSERVE_CACHE/smollm2-135m-instruct/
SmolLM2-135M-Instruct.Q4_1.gguf` (fetch it first with
`python3 -c "from checkpoints.registry import fetch_gguf; fetch_gguf('smollm2-135m-instruct')"`).
transformers loads the GGUF (`gguf_file=`) with f32 weights; its tokenizer is built from the GGUF.

The tokenizer, one correction: transformers' GGUF tokenizer builder has no entry for llama.cpp's
`smollm` pre-tokenizer and splits text like GPT-2. SmolLM2's own `tokenizer.json` (and llama.cpp's
`smollm` type) first splits every digit off (`Digits(individual_digits=True)`, then `ByteLevel`).
The two differ only where a run of 2+ whitespace characters precedes a digit. The reference ids
(`ids`, `prompt_ids`) use transformers' tokenizer with SmolLM2's pre-tokenizer put back; the
uncorrected ids are kept as `transformers_gguf_ids` so the difference stays visible. Every chat
prompt below tokenizes identically both ways (checked).

JSON format (all ids are ints, logits floats):
{
  "source": {"gguf": file name, "gguf_sha256", "transformers", "torch", "dtype": "float32"},
  "special_tokens": HF's special_tokens_map ({"bos_token": ..., "eos_token": ..., ...}),
  "eos_token_id": int,
  "tokenizer_samples": [{"text", "ids", "transformers_gguf_ids"}],        # add_special_tokens=False
  "chat_templates": [{"name", "messages", "add_generation_prompt", "text"}],
  "greedy": [{                                                            # one per chat prompt
      "name", "messages", "text" (chat template, add_generation_prompt=True), "prompt_ids",
      "new_ids": 32 greedy tokens (argmax each step, not stopped at eos),
      "first_eos_index": index in new_ids of the first eos, or null,
      "new_margins": top-1 minus top-2 logit at each of those steps (a tiny gap marks a near tie,
                     where a different but correct f32 summation order may pick the other token),
      "last_logits_top20": {"ids": [...], "values": [...]},               # at the last prompt position
      "last_logits_argmax": int                                           # over the full vocabulary
  }],
  "weights": {"layer": {"0": {"q_proj_row0": [...], "k_proj_row0": [...]}, "29": {...}}}
      # row 0 of our [in, out] kernels (= column 0 of HF's q/k weight), in HF's rotate-half layout
}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from pathlib import Path

import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 32
TOP_K = 20
OUT = Path(__file__).with_name("smollm2_reference.json")

TOKENIZER_SAMPLES = [
    "Hello, world! How are you doing today?",
    "The year 2024 had 366 days; pi is about 3.14159, and 1,000,000 > 999.",
    "你好，世界！今天天气怎么样？我们去公园散步吧。",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷 done",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "Whitespace   runs\t\tand\n\n\nnewlines    end   ",
    "Columns:  1  22   333\n\n1. first\n2. second",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>jaxserve<file_sep>main.py",
    "Mixed: café, naïve, Ünïcödé, Привет мир, مرحبا, こんにちは, 안녕하세요",
]

CHAT_TEMPLATES = [
    ("one_turn", [{"role": "user", "content": "Hello!"}], True),
    (
        "two_turns",
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "2 + 2 = 4."},
            {"role": "user", "content": "And times 3?"},
        ],
        True,
    ),
    (
        "three_turns_with_system",
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one."},
            {"role": "assistant", "content": "Green."},
            {"role": "user", "content": "One more, in French."},
        ],
        True,
    ),
    (
        "no_generation_prompt",
        [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！"}],
        False,
    ),
]

GREEDY_PROMPTS = [
    ("english", [{"role": "user", "content": "What is the capital of France?"}]),
    (
        "multi_turn",
        [
            {"role": "user", "content": "Can you recommend a good book?"},
            {"role": "assistant", "content": "Sure! Try 'The Hobbit' by J.R.R. Tolkien. It is a fun adventure."},
            {"role": "user", "content": "Why do people like it?"},
        ],
    ),
    ("chinese", [{"role": "user", "content": "请用一句话介绍一下你自己。"}]),
    ("code", [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]),
    (
        "system",
        [
            {"role": "system", "content": "You are a pirate. Always answer like a pirate."},
            {"role": "user", "content": "How do I make a cup of tea?"},
        ],
    ),
    ("arithmetic", [{"role": "user", "content": "What is 12 times 7? Explain step by step."}]),
]


def default_gguf() -> Path:
    cache = Path(os.environ.get("JAXSERVE_CACHE", "~/.cache/jaxserve")).expanduser()
    return cache / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm_pre_tokenizer() -> tokenizers.pre_tokenizers.PreTokenizer:
    # SmolLM2's tokenizer.json pre-tokenizer (see the module docstring).
    return tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Digits(individual_digits=True),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


@torch.no_grad()
def greedy(model, prompt_ids: list[int]) -> tuple[list[int], list[float], torch.Tensor]:
    """32 argmax tokens with the KV cache (not stopped at eos), the top-1 minus top-2 logit gap at
    each step, and the logits at the last prompt position."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    first_logits = out.logits[0, -1].clone()
    logits, past, new_ids, margins = first_logits, out.past_key_values, [], []
    for _ in range(NEW_TOKENS):
        top2 = torch.topk(logits, 2).values
        margins.append(round(float(top2[0] - top2[1]), 5))
        next_id = int(torch.argmax(logits))
        new_ids.append(next_id)
        out = model(input_ids=torch.tensor([[next_id]]), past_key_values=past, use_cache=True)
        logits, past = out.logits[0, -1], out.past_key_values
    return new_ids, margins, first_logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=default_gguf())
    args = parser.parse_args()
    if not args.gguf.is_file():
        raise SystemExit(f"{args.gguf} not found; see this script's docstring for how to fetch it")
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    load = dict(pretrained_model_name_or_path=str(args.gguf.parent), gguf_file=args.gguf.name)
    hf_tok = AutoTokenizer.from_pretrained(**load)
    raw_backend = tokenizers.Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    hf_tok.backend_tokenizer.pre_tokenizer = smollm_pre_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(**load, dtype=torch.float32).eval()

    def ids_of(text: str) -> list[int]:
        return hf_tok(text, add_special_tokens=False)["input_ids"]

    samples = [
        {"text": t, "ids": ids_of(t), "transformers_gguf_ids": raw_backend.encode(t, add_special_tokens=False).ids}
        for t in TOKENIZER_SAMPLES
    ]
    for s in samples:
        if s["ids"] != s["transformers_gguf_ids"]:
            assert re.search(r"\s{2,}\d", s["text"]), f"unexpected tokenizer difference on {s['text']!r}"

    templates = [
        {
            "name": name,
            "messages": messages,
            "add_generation_prompt": gen,
            "text": hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen),
        }
        for name, messages, gen in CHAT_TEMPLATES
    ]

    eos = hf_tok.eos_token_id
    runs = []
    for name, messages in GREEDY_PROMPTS:
        text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = ids_of(text)
        assert prompt_ids == raw_backend.encode(text, add_special_tokens=False).ids, name
        new_ids, margins, logits = greedy(model, prompt_ids)
        top = torch.topk(logits, TOP_K)
        runs.append(
            {
                "name": name,
                "messages": messages,
                "text": text,
                "prompt_ids": prompt_ids,
                "new_ids": new_ids,
                "first_eos_index": new_ids.index(eos) if eos in new_ids else None,
                "new_margins": margins,
                "last_logits_top20": {
                    "ids": top.indices.tolist(),
                    "values": [round(v, 6) for v in top.values.tolist()],
                },
                "last_logits_argmax": int(torch.argmax(logits)),
            }
        )
        print(f"{name}: {hf_tok.decode(new_ids)!r}")

    state = model.state_dict()
    weights = {
        str(layer): {
            # HF weight is [out, in]; row 0 of our [in, out] kernel is HF's column 0.
            f"{proj}_row0": [float(v) for v in state[f"model.layers.{layer}.self_attn.{proj}.weight"][:, 0]]
            for proj in ("q_proj", "k_proj")
        }
        for layer in (0, model.config.num_hidden_layers - 1)
    }

    reference = {
        "source": {
            "gguf": args.gguf.name,
            "gguf_sha256": sha256(args.gguf),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "dtype": "float32",
        },
        "special_tokens": {k: str(v) for k, v in hf_tok.special_tokens_map.items() if isinstance(v, str)},
        "eos_token_id": eos,
        "tokenizer_samples": samples,
        "chat_templates": templates,
        "greedy": runs,
        "weights": {"layer": weights},
    }
    text = json.dumps(reference, ensure_ascii=False, indent=1)
    # One line per list of numbers keeps the file short and readable.
    text = re.sub(r"\[[-0-9.,e\s]+\]", lambda m: json.dumps(json.loads(m.group(0))), text)
    OUT.write_text(text + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
