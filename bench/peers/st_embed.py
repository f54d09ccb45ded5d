"""Peer: sentence-transformers on torch (CPU), an encoder embedding model's own pipeline
(tokenizer, Transformer, Pooling, Normalize modules).

Standalone script (imports no jaxserve code), run by `bench.embeddings` in any interpreter that has
torch and sentence-transformers:

    python st_embed.py JOB.json OUT.json

JOB: {"model_dir": sentence-transformers directory, "threads": int, "batch_size": int,
      "runs": [[text, ...], ...]}  (the first run warms up and is not timed)
OUT: {"seconds": [one per timed run], "embeddings": [unit vectors of the first timed run's texts],
      "versions": {...}}
Exit code 3, and {"unavailable": message} in OUT, when a dependency is missing.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

MISSING_DEPENDENCY = 3


def main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    try:
        import sentence_transformers
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        message = f"the sentence-transformers peer needs torch and sentence-transformers in {sys.executable} ({e})"
        Path(out_path).write_text(json.dumps({"unavailable": message}))
        sys.exit(MISSING_DEPENDENCY)
    torch.set_num_threads(job["threads"])
    model = SentenceTransformer(job["model_dir"], device="cpu")

    def embed(texts: list[str]) -> list[list[float]]:
        vectors = model.encode(texts, batch_size=job["batch_size"], convert_to_tensor=True)
        return torch.nn.functional.normalize(vectors, dim=-1).tolist()

    embed(job["runs"][0])
    seconds, first = [], None
    for texts in job["runs"][1:]:
        t0 = time.perf_counter()
        vectors = embed(texts)
        seconds.append(time.perf_counter() - t0)
        first = first or vectors
    versions = {"torch": torch.__version__, "sentence_transformers": sentence_transformers.__version__}
    Path(out_path).write_text(json.dumps({"seconds": seconds, "embeddings": first, "versions": versions}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
