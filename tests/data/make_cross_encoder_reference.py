"""Make tests/data/cross_encoder_reference.json: sentence-transformers' `CrossEncoder` scores of a
tiny random reranker, the reference for `/v1/score` and `/v1/rerank` on a cross-encoder.

Run with the reference venv (torch + transformers + sentence-transformers; not jaxserve dependencies):

    /work/venv-st/bin/python tests/data/make_cross_encoder_reference.py [--jaxserve-python python3]

jaxserve's interpreter writes the directory (`tests/encoder_dirs.write_cross_encoder`: a one-label
`BertForSequenceClassification` whose weights are drawn from jaxserve's declaration, seed
`CROSS_ENCODER_SEED`, and a WordPiece tokenizer with BERT's pair template); transformers must load every
weight of it (no missing or unexpected key); `CrossEncoder.predict` scores each pair (its default
activation for one label, a sigmoid) and the raw logits are recorded too. The tests write the same
directory again, so no weights are committed.

JSON format: {"source": {...}, "pairs": [{"query", "document", "ids", "type_ids", "logit", "score"}]}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

import sentence_transformers
import tokenizers
import torch
import transformers
from transformers import AutoModelForSequenceClassification

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("cross_encoder_reference.json")
WRITE = ROOT / "tests" / "encoder_dirs.py"  # run as a script: writes the reranker's directory
PAIRS = [
    ("what is the capital of france", "paris is the capital of france"),
    ("what is the capital of france", "a dog sat on the mat"),
    ("where is the big river", "the cat sat on a mat"),
    ("hello world", "hello worlds hello world hello world hello world hello world hello world"),
    ("cat", "a big cat sat on the mat where the dog sat"),
]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jaxserve-python", default="python3")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        subprocess.run([args.jaxserve_python, str(WRITE), tmp], check=True, env=env, cwd=ROOT)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            tmp, dtype=torch.float32, output_loading_info=True
        )
        problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if problems:
            raise SystemExit(f"the cross-encoder did not load cleanly: {problems}")
        model.eval()
        tokenizer = tokenizers.Tokenizer.from_file(f"{tmp}/tokenizer.json")
        tokenizer.no_padding()
        scores = sentence_transformers.CrossEncoder(tmp, device="cpu").predict(PAIRS)
        pairs = []
        for (query, document), score in zip(PAIRS, scores):
            encoding = tokenizer.encode(query, document)
            logit = model(
                input_ids=torch.tensor([encoding.ids]), token_type_ids=torch.tensor([encoding.type_ids])
            ).logits[0, 0]
            pairs.append(
                {
                    "query": query,
                    "document": document,
                    "ids": encoding.ids,
                    "type_ids": encoding.type_ids,
                    "logit": round(float(logit), 7),
                    "score": round(float(score), 7),
                }
            )
        weights = hashlib.sha256(Path(f"{tmp}/model.safetensors").read_bytes()).hexdigest()
    source = {
        "transformers": transformers.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "weights_sha256": weights,
    }
    lines = ",\n  ".join(json.dumps(p) for p in pairs)
    OUT.write_text(f'{{"source": {json.dumps(source)},\n "pairs": [\n  {lines}\n ]}}\n')
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
