"""Peer: Hugging Face transformers on torch (CPU), embeddings as pooled final hidden states.

Standalone script (imports no jaxserve code), run by `bench.embeddings` in any interpreter that has
torch, transformers, accelerate and gguf:

    python hf_embed.py JOB.json OUT.json

JOB: {"gguf": path, "threads": int, "batch_size": int, "pooling": "last" | "mean",
      "runs": [[token ids of each text], ...]}  (the first run warms up and is not timed)
OUT: {"seconds": [one per timed run], "embeddings": [unit vectors of the first timed run's texts],
      "versions": {...}}
Each batch is right-padded with an attention mask (real tokens never attend to padding, and keep
their positions), `last_hidden_state` (after the final norm) is pooled at the last real token or
over the real tokens, and scaled to unit length.
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
        import accelerate  # noqa: F401  (transformers needs it to load GGUF files)
        import gguf  # noqa: F401
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        Path(out_path).write_text(
            json.dumps(
                {
                    "unavailable": f"the transformers peer needs torch, transformers, "
                    f"accelerate and gguf in {sys.executable} ({e})"
                }
            )
        )
        sys.exit(MISSING_DEPENDENCY)
    torch.set_num_threads(job["threads"])
    gguf_path = Path(job["gguf"])
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()

    @torch.no_grad()
    def embed(texts: list[list[int]]) -> list[list[float]]:
        out = []
        for start in range(0, len(texts), job["batch_size"]):
            batch = texts[start : start + job["batch_size"]]
            lengths = torch.tensor([len(ids) for ids in batch])
            ids = torch.zeros((len(batch), int(lengths.max())), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, text in enumerate(batch):
                ids[row, : len(text)] = torch.tensor(text)
                mask[row, : len(text)] = 1
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            if job["pooling"] == "last":
                pooled = hidden[torch.arange(len(batch)), lengths - 1]
            else:
                pooled = (hidden * mask[..., None]).sum(dim=1) / lengths[:, None]
            out += torch.nn.functional.normalize(pooled, dim=-1).tolist()
        return out

    embed(job["runs"][0])
    seconds, first = [], None
    for texts in job["runs"][1:]:
        t0 = time.perf_counter()
        vectors = embed(texts)
        seconds.append(time.perf_counter() - t0)
        first = first or vectors
    Path(out_path).write_text(
        json.dumps(
            {
                "seconds": seconds,
                "embeddings": first,
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
