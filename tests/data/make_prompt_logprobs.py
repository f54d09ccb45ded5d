"""Make tests/data/smollm2_prompt_logprobs.json: transformers' prompt log-probabilities on the
default model, for the chat prompts of smollm2_reference.json (see make_reference.py for the
model file and the reference venv):

    /work/refvenv/bin/python tests/data/make_prompt_logprobs.py [--gguf PATH]

For each prompt: the log-probability (log_softmax of f32 logits, computed in f64) of every
prompt token after the first, given the tokens before it, from one forward pass over the prompt.

JSON format: {"source": {...}, "prompts": [{"name", "prompt_ids", "logprobs": [...]}]}
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import transformers
from make_reference import OUT as REFERENCE
from make_reference import default_gguf, sha256
from transformers import AutoModelForCausalLM

OUT = Path(__file__).with_name("smollm2_prompt_logprobs.json")


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=default_gguf())
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(
        str(args.gguf.parent), gguf_file=args.gguf.name, dtype=torch.float32
    ).eval()
    prompts = []
    for run in json.loads(REFERENCE.read_text())["greedy"]:
        ids = run["prompt_ids"]
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
        logprobs = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), ids[1:]]
        prompts.append({"name": run["name"], "prompt_ids": ids, "logprobs": [round(float(v), 6) for v in logprobs]})
    source = {
        "gguf": args.gguf.name,
        "gguf_sha256": sha256(args.gguf),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
    }
    OUT.write_text(json.dumps({"source": source, "prompts": prompts}) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
