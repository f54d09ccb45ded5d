"""Make tests/data/smollm2_embeddings.json: transformers' pooled hidden states on the default model,
the reference for `/v1/embeddings` (see make_reference.py for the model file and the reference venv):

    /work/refvenv/bin/python tests/data/make_embeddings.py [--gguf PATH]

For each text: its token ids (transformers' tokenizer of the GGUF, no special tokens added, as
jaxserve's for these texts), and the model's final hidden states (`last_hidden_state`, after the
final norm, f32) of one forward pass, pooled two ways, each scaled to unit length: the last token's
("last") and the mean over all tokens ("mean").

JSON format: {"source": {...}, "texts": [{"text", "ids", "last": [...], "mean": [...]}]}
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import transformers
from make_reference import default_gguf, sha256
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT = Path(__file__).with_name("smollm2_embeddings.json")
TEXTS = [
    "The capital of France is Paris.",
    "A quick brown fox jumps over the lazy dog while the farmer watches from the porch, wondering whether "
    "the dog will ever wake up, and the sun sets slowly behind the old red barn at the end of the field "
    "where the children used to play on long summer evenings before the storm came. Later that night the "
    "wind rose, the shutters rattled against the stone walls, and the whole family gathered in the kitchen "
    "to listen to the rain and tell the old stories once again.",
    "Embeddings map text to vectors.",
]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=default_gguf())
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(
        str(args.gguf.parent), gguf_file=args.gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name)
    texts = []
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
        pooled = {"last": hidden[-1], "mean": hidden.mean(dim=0)}
        texts.append(
            {"text": text, "ids": ids, **{k: [round(float(x), 7) for x in v / v.norm()] for k, v in pooled.items()}}
        )
    source = {
        "gguf": args.gguf.name,
        "gguf_sha256": sha256(args.gguf),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
    }
    OUT.write_text(json.dumps({"source": source, "texts": texts}) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
