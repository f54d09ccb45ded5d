"""Make tests/data/lora_reference.json: transformers + PEFT greedy tokens with random LoRA adapters.

Run with the reference venv (torch + transformers + peft + gguf; not jaxserve dependencies):

    /work/refvenv/bin/python tests/data/make_lora_reference.py [--jaxserve-python python3] [--only tiny|default]

Two base models, each run in f32 on CPU, greedy (argmax, not stopped at eos), every adapter
applied with `PeftModel.from_pretrained` (unmerged, as PEFT serves it):

- `tiny`: the tiny random Llama (`checkpoints.tiny_random`, seed 0), written as a Hugging Face
  directory by jaxserve's interpreter (`--jaxserve-python`); adapters `TINY_ADAPTERS`.
- `default`: the registry's default model, SmolLM2-135M-Instruct (its GGUF, `gguf_file=`; fetch it
  first with `python3 -c "from checkpoints.registry import fetch_gguf; fetch_gguf('smollm2-135m-instruct')"`);
  adapters `DEFAULT_ADAPTERS`.

The adapters are written by tests/data/lora_adapters.py from seeded numpy (the tests write the
same bytes again), so no weights are committed. Prompts are random token ids (tiny) or fixed ids.

JSON format:
{
  "source": {"transformers", "torch", "peft", "dtype": "float32"},
  MODEL: {"adapters": {name: {"adapter_sha256": of its safetensors file,
                               "cases": [{"prompt_ids", "new_ids", "new_margins"}]}},
          "base": {"cases": [...]}}
}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import peft
import torch
import transformers
from peft import PeftModel

sys.path.insert(0, str(Path(__file__).parent))
from lora_adapters import DEFAULT_ADAPTERS, TINY_ADAPTERS, module_features, write_adapter  # noqa: E402
from make_family_reference import greedy, load_checked  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("lora_reference.json")
NEW_TOKENS = 16
WRITE_TINY = """
import sys
from checkpoints.hf import save_hf_dir
from checkpoints.tiny_random import build_tiny_random
model = build_tiny_random(family="llama")
save_hf_dir(model.params, model.config, model.tokenizer_bundle, sys.argv[1])
"""
# The default model's prompts: the first two chats of its transformers reference.
DEFAULT_PROMPTS = [
    case["prompt_ids"]
    for case in json.loads(Path(__file__).with_name("smollm2_reference.json").read_text())["greedy"][:2]
]


def cases_for(model, prompts: list[list[int]]) -> list[dict]:
    out = []
    for prompt in prompts:
        new_ids, margins = greedy(model, prompt, NEW_TOKENS)
        out.append({"prompt_ids": prompt, "new_ids": new_ids, "new_margins": margins})
    return out


def with_adapters(base, config, specs, prompts: list[list[int]], tmp: Path) -> dict:
    features = module_features(
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.hidden_size // config.num_attention_heads,
    )
    result = {"base": {"cases": cases_for(base, prompts)}, "adapters": {}}
    for spec in specs:
        directory = write_adapter(tmp / spec.name, spec, config.num_hidden_layers, features)
        model = PeftModel.from_pretrained(base, str(directory)).eval()
        cases = cases_for(model, prompts)
        base = model.unload()  # the base model without the adapter's layers, for the next one
        digest = hashlib.sha256((directory / "adapter_model.safetensors").read_bytes()).hexdigest()
        result["adapters"][spec.name] = {"adapter_sha256": digest, "cases": cases}
        print(f"{spec.name}: {[c['new_ids'][:8] for c in cases]}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jaxserve-python", default="python3", help="an interpreter with jaxserve's dependencies")
    parser.add_argument("--only", choices=("tiny", "default"), help="remake one model's part; the other is kept")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    reference = json.loads(OUT.read_text()) if OUT.is_file() else {}
    reference["source"] = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "peft": peft.__version__,
        "dtype": "float32",
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.only in (None, "tiny"):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
            subprocess.run([args.jaxserve_python, "-c", WRITE_TINY, str(tmp / "tiny")], check=True, env=env, cwd=ROOT)
            base = load_checked(pretrained_model_name_or_path=str(tmp / "tiny"))
            rng = np.random.default_rng(1)
            prompts = [[int(i) for i in rng.integers(3, base.config.vocab_size, n)] for n in (6, 21)]
            reference["tiny"] = with_adapters(base, base.config, TINY_ADAPTERS, prompts, tmp)
        if args.only in (None, "default"):
            cache = Path(os.environ.get("JAXSERVE_CACHE", "~/.cache/jaxserve")).expanduser()
            gguf = cache / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
            if not gguf.is_file():
                raise SystemExit(f"{gguf} not found; see this script's docstring for how to fetch it")
            base = load_checked(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
            reference["default"] = with_adapters(base, base.config, DEFAULT_ADAPTERS, DEFAULT_PROMPTS, tmp)
    text = json.dumps(reference, indent=1)
    text = re.sub(r"\[[-0-9.,e\s]+\]", lambda m: json.dumps(json.loads(m.group(0))), text)
    OUT.write_text(text + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
