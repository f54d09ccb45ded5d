"""Make tests/data/family_reference.json: transformers' greedy tokens on every family jaxserve serves.

Run with the reference venv (torch + transformers + gguf; not jaxserve dependencies):

    /work/refvenv/bin/python tests/data/make_family_reference.py [--jaxserve-python python3] [--only NAME ...]

Two kinds of models, each run by transformers in f32 on CPU, greedy (argmax, not stopped at eos):

- Tiny random models of each family (`checkpoints.tiny_random.TINY_FAMILIES`: Qwen2, Qwen3,
  Mistral with a window shorter than the prompts, Gemma 3, Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss,
  Llama, the Qwen3.5 and Qwen3-Next Gated DeltaNet hybrids). jaxserve's
  interpreter (`--jaxserve-python`) draws their weights from the architecture's declaration (seed 0)
  and writes them as Hugging Face directories (`save_hf_dir`); transformers loads those directories
  (every weight must load: missing or unexpected keys stop the script). The tests draw the same
  weights again, so no weights are committed. Prompts are random token ids. gpt-oss also gets a
  prompt longer than a prefill chunk of the tests (64 tokens) and one that shares the first 40
  tokens of it (`shared_prefix`: the tests run it after the others, from the prefix cache), and
  its entry records the `config.json` transformers itself writes (`hf_config`, from
  `save_pretrained`), which the tests parse. `gpt_oss_mxfp4` is that model with its experts
  stored as MXFP4 blocks and scales, which transformers dequantizes on load
  (`Mxfp4Config(dequantize=True)`).
- The two real GGUF models of the registry, `qwen2.5-coder-0.5b-instruct` and `gemma-3-270m`
  (fetch them first: `python3 -c "from checkpoints.registry import fetch_gguf; fetch_gguf(NAME)"`),
  loaded by transformers with `gguf_file=`. Qwen's prompts are chats rendered with its template;
  Gemma 3 270M is a base model: plain text prompts (one longer than its 512-token window) and one
  prompt in Gemma's turn format. Tokenizer samples record transformers' ids of a few texts.

JSON format:
{
  "source": {"transformers", "torch", "dtype": "float32"},
  "tiny": {family: {"seed": 0, "weights_sha256": of the safetensors file, "cases": [CASE]}},
  "real": {name: {"gguf", "gguf_sha256", "tokenizer_samples": [{"text", "ids"}], "cases": [CASE]}}
}
Tiny families also have "shared_prefix_case" unless a case of theirs shares a prefix (a CASE whose
prompt starts with the first 40 tokens of the longest case's, for runs after it that hit the prefix
cache) and "hf_config" (the
`config.json` transformers itself writes for the model, `save_pretrained`).
CASE = {"name", "text" (real models; ids with add_special_tokens as `special`), "special",
        "shared_prefix" (the case whose first tokens it repeats),
        "messages" (chats: the conversation `text` renders), "prompt_ids", "new_ids",
        "new_margins" (top-1 minus top-2 logit per step)}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("family_reference.json")
TINY_NEW_TOKENS = 24
REAL_NEW_TOKENS = 32
TINY_PROMPT_LENGTHS = (6, 21, 45)
TINY_FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3",
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
    "gpt_oss_mxfp4",
    "qwen3_5",
    "qwen3_next",
)
SHARED_PREFIX = 40  # the generic shared-prefix case: the longest prompt's first tokens, then new ones
# Per family, prompts beyond TINY_PROMPT_LENGTHS: (length, and for a shared prefix: the case and
# how many of its first tokens). Hybrids (per-sequence state) get one longer than the tests' prefill
# chunk (64 tokens).
EXTRA_PROMPTS = {
    "gpt_oss": [(90, None), (50, ("random_90", 40))],
    "qwen3_5": [(100, None)],
    "qwen3_next": [(100, None)],
}

WRITE_TINY = """
import sys
from checkpoints.hf import save_hf_dir
from checkpoints.tiny_random import build_tiny_random
for family in sys.argv[2:]:
    model = build_tiny_random(family=family)
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, f"{sys.argv[1]}/{family}")
"""

QWEN_CHATS = [
    ("capital", [{"role": "user", "content": "What is the capital of France?"}]),
    ("prime", [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]),
    (
        "system",
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Explain a hash map in one sentence."},
        ],
    ),
    ("chinese", [{"role": "user", "content": "用一句话解释什么是递归。"}]),
]
PARAGRAPH = (
    "The river wound through the valley, past farms and orchards, under old stone bridges, until it "
    "reached the town where the market opened every Saturday and the bakers sold bread still warm. "
)
GEMMA_PROMPTS = [
    ("capital", "The capital of France is", True),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', True),
    ("long", PARAGRAPH * 18 + "In summary, the town", True),
    ("turns", "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n", False),
]
TOKENIZER_SAMPLES = [
    "Hello, world! How are you doing today?",
    "The year 2024 had 366 days; pi is about 3.14159, and 1,000,000 > 999.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "Whitespace   runs\t\tand\n\n\nnewlines    end   ",
    "Mixed: café, naïve, Привет мир, こんにちは, 你好，世界！ 😀👍🏽",
]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


@torch.no_grad()
def greedy(model, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    logits, past, new_ids, margins = out.logits[0, -1], out.past_key_values, [], []
    for _ in range(new_tokens):
        top2 = torch.topk(logits, 2).values
        margins.append(round(float(top2[0] - top2[1]), 5))
        next_id = int(torch.argmax(logits))
        new_ids.append(next_id)
        out = model(input_ids=torch.tensor([[next_id]]), past_key_values=past, use_cache=True)
        logits, past = out.logits[0, -1], out.past_key_values
    return new_ids, margins


def load_checked(**kwargs):
    """A model whose every weight came from the checkpoint (none missing or left over)."""
    model, info = AutoModelForCausalLM.from_pretrained(**kwargs, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise SystemExit(f"{kwargs}: weights did not load cleanly: {problems}")
    return model.eval()


def tiny_cases(jaxserve_python: str, families: list[str]) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        subprocess.run([jaxserve_python, "-c", WRITE_TINY, tmp, *families], check=True, env=env, cwd=ROOT)
        for family in families:
            directory = Path(tmp) / family
            quantized = "quantization_config" in json.loads((directory / "config.json").read_text())
            extra = {"quantization_config": Mxfp4Config(dequantize=True)} if quantized else {}
            model = load_checked(pretrained_model_name_or_path=str(directory), **extra)
            vocab = model.config.vocab_size
            cases = [
                {**case, "new_ids": new_ids, "new_margins": margins}
                for case in tiny_prompts(family, vocab)
                for new_ids, margins in [greedy(model, case["prompt_ids"], TINY_NEW_TOKENS)]
            ]
            out[family] = {"seed": 0, "weights_sha256": sha256(directory / "model.safetensors"), "cases": cases}
            if not any("shared_prefix" in case for case in cases):  # else it has one of its own
                prompt = shared_prefix_prompt(vocab, cases[len(TINY_PROMPT_LENGTHS) - 1]["prompt_ids"])
                new_ids, margins = greedy(model, prompt, TINY_NEW_TOKENS)
                out[family]["shared_prefix_case"] = {
                    "name": "shared_prefix",
                    "prompt_ids": prompt,
                    "new_ids": new_ids,
                    "new_margins": margins,
                }
            model.save_pretrained(Path(tmp) / f"{family}-saved")
            out[family]["hf_config"] = json.loads((Path(tmp) / f"{family}-saved" / "config.json").read_text())
            print(f"{family}: {[c['new_ids'][:8] for c in cases]}", flush=True)
    return out


def tiny_prompts(family: str, vocab: int) -> list[dict]:
    """The random prompts of a tiny family: {"name", "prompt_ids"} (and "shared_prefix")."""
    rng = np.random.default_rng(1)
    cases = [
        {"name": f"random_{n}", "prompt_ids": [int(i) for i in rng.integers(3, vocab, n)]} for n in TINY_PROMPT_LENGTHS
    ]
    for n, shared in EXTRA_PROMPTS.get(family, []):
        case = {"name": f"random_{n}", "prompt_ids": [int(i) for i in rng.integers(3, vocab, n)]}
        if shared is not None:
            source, length = shared
            prefix = next(c["prompt_ids"] for c in cases if c["name"] == source)[:length]
            prompt = prefix + case["prompt_ids"][length:]
            case = {"name": "shared_prefix", "shared_prefix": source, "prompt_ids": prompt}
        cases.append(case)
    return cases


def shared_prefix_prompt(vocab: int, longest: list[int]) -> list[int]:
    """The generic shared-prefix case: the longest prompt's first SHARED_PREFIX tokens, then 9 drawn
    after the prompts (`tiny_prompts`'s generator, continued)."""
    rng = np.random.default_rng(1)
    for n in TINY_PROMPT_LENGTHS:
        rng.integers(3, vocab, n)
    return longest[:SHARED_PREFIX] + [int(i) for i in rng.integers(3, vocab, 9)]


def real_cases(name: str, gguf: Path) -> dict:
    load = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**load)
    model = load_checked(**load)
    if name.startswith("qwen"):
        prompts = [
            (case, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False, messages)
            for case, messages in QWEN_CHATS
        ]
    else:
        prompts = [(case, text, special, None) for case, text, special in GEMMA_PROMPTS]
    cases = []
    for case, text, special, messages in prompts:
        prompt_ids = tokenizer(text, add_special_tokens=special)["input_ids"]
        new_ids, margins = greedy(model, prompt_ids, REAL_NEW_TOKENS)
        cases.append(
            {
                "name": case,
                "text": text,
                "special": special,
                "prompt_ids": prompt_ids,
                "new_ids": new_ids,
                "new_margins": margins,
                **({"messages": messages} if messages else {}),
            }
        )
        print(f"{name} {case} ({len(prompt_ids)} tokens): {tokenizer.decode(new_ids)!r}", flush=True)
    samples = [{"text": t, "ids": tokenizer(t, add_special_tokens=False)["input_ids"]} for t in TOKENIZER_SAMPLES]
    return {"gguf": gguf.name, "gguf_sha256": sha256(gguf), "tokenizer_samples": samples, "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jaxserve-python", default="python3", help="an interpreter with jaxserve's dependencies")
    parser.add_argument("--only", nargs="*", help="tiny families or real model names to (re)make; others are kept")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    cache = Path(os.environ.get("JAXSERVE_CACHE", "~/.cache/jaxserve")).expanduser()
    real = {
        "qwen2.5-coder-0.5b-instruct": cache
        / "qwen2.5-coder-0.5b-instruct"
        / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "gemma-3-270m": cache / "gemma-3-270m" / "gemma-3-270m-q4_k_m.gguf",
    }
    wanted = set(args.only or [*TINY_FAMILIES, *real])
    reference = json.loads(OUT.read_text()) if OUT.is_file() else {"tiny": {}, "real": {}}
    reference["source"] = {"transformers": transformers.__version__, "torch": torch.__version__, "dtype": "float32"}
    families = [f for f in TINY_FAMILIES if f in wanted]
    if families:
        reference["tiny"].update(tiny_cases(args.jaxserve_python, families))
    for name, gguf in real.items():
        if name in wanted:
            if not gguf.is_file():
                raise SystemExit(f"{gguf} not found; see this script's docstring for how to fetch it")
            reference["real"][name] = real_cases(name, gguf)
    text = json.dumps(reference, ensure_ascii=False, indent=1)
    text = re.sub(r"\[[-0-9.,e\s]+\]", lambda m: json.dumps(json.loads(m.group(0))), text)
    OUT.write_text(text + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
