"""Peer: Hugging Face transformers on torch (CPU), batched greedy `generate` with left padding.

Standalone script (imports no jaxserve code), run by `bench.peers.runner` in any interpreter that
has torch, transformers, accelerate and gguf:

    python hf_generate.py JOB.json OUT.json

JOB: {"gguf": path, "threads": int, "mode": "throughput" | "latency", "batch_size": int,
      "requests": [{"prompt_token_ids": [...], "max_tokens": n}], "iters": int, "warmup_iters": int}
Latency mode, iteration i: requests[2i] with one new token (prefill time), then requests[2i + 1]
in full (latency); fresh prompts, so no prefix cache can help.
Exit code 3, and {"unavailable": message} in OUT, when a dependency is missing.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

MISSING_DEPENDENCY = 3


def _import_torch_stack(out_path: str):
    try:
        import accelerate  # noqa: F401  (transformers needs it to load GGUF files)
        import gguf  # noqa: F401
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        message = (f"the transformers peer needs torch, transformers, accelerate and gguf in {sys.executable} "
                   f"({e}); install them there (pip install torch transformers accelerate gguf), or pass "
                   f"--peer-python with an interpreter that has them")  # fmt: skip
        Path(out_path).write_text(json.dumps({"unavailable": message}))
        sys.exit(MISSING_DEPENDENCY)
    return torch, transformers, AutoModelForCausalLM


def _generate(torch, model, batch: list[dict], pad_id: int) -> None:
    """One left-padded greedy batch, exactly max(max_tokens) new tokens for every row (EOS ignored)."""
    width = max(len(r["prompt_token_ids"]) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        n = len(r["prompt_token_ids"])
        ids[row, width - n :] = torch.tensor(r["prompt_token_ids"], dtype=torch.long)
        mask[row, width - n :] = 1
    new = max(r["max_tokens"] for r in batch)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=pad_id)  # fmt: skip


def main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    torch, transformers, AutoModelForCausalLM = _import_torch_stack(out_path)
    torch.set_num_threads(job["threads"])
    gguf = Path(job["gguf"])
    t0 = time.perf_counter()
    dtype = job.get("dtype", "float32")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype))
    model.eval()
    load_s = time.perf_counter() - t0
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else int(pad_id)
    requests = job["requests"]
    result = {"peer": "transformers", "load_s": load_s, "threads": job["threads"], "dtype": dtype,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}  # fmt: skip
    if job["mode"] == "throughput":
        size = job["batch_size"]
        batches = [requests[i : i + size] for i in range(0, len(requests), size)]
        t0 = time.perf_counter()
        for k, batch in enumerate(batches):
            _generate(torch, model, batch, pad_id)
            print(f"transformers: batch {k + 1}/{len(batches)} done at {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
        result["elapsed_s"] = time.perf_counter() - t0
        result["batch_size"] = size
        result["generated_tokens_total"] = sum(len(b) * max(r["max_tokens"] for r in b) for b in batches)
    else:
        prefill, full = [], []
        for i in range(job["warmup_iters"] + job["iters"]):
            t0 = time.perf_counter()
            _generate(torch, model, [{**requests[2 * i], "max_tokens": 1}], pad_id)
            t1 = time.perf_counter()
            _generate(torch, model, [requests[2 * i + 1]], pad_id)
            t2 = time.perf_counter()
            if i >= job["warmup_iters"]:
                prefill.append(t1 - t0)
                full.append(t2 - t1)
        result["prefill_s"] = prefill
        result["latency_s"] = full
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
