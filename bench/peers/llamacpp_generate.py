"""Peer: llama.cpp through llama-cpp-python's `Llama` (CPU), greedy, one request at a time.

Standalone script (imports no jaxserve code), run by `bench.peers.runner` in an interpreter that
has llama-cpp-python (built from source by `pip install llama-cpp-python`):

    python llamacpp_generate.py JOB.json OUT.json

The job format is hf_generate.py's. llama-cpp-python has no batched generation, so throughput
mode runs the requests one after another. The raw token generator does not stop at EOS, so each
request produces exactly its `max_tokens`. Exit code 3, and {"unavailable": message} in OUT,
when llama_cpp cannot be imported.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

MISSING_DEPENDENCY = 3


def _generate(llm, prompt_ids: list[int], max_tokens: int) -> None:
    """Greedy generation of exactly max_tokens tokens."""
    for count, _ in enumerate(
        llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True), 1
    ):
        if count == max_tokens:
            break


def main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    try:
        import llama_cpp
    except ImportError as e:
        message = (f"the llama-cpp peer needs llama-cpp-python in {sys.executable} ({e}); install it there "
                   f"(pip install llama-cpp-python; it builds from source in a few minutes), or pass "
                   f"--peer-python with an interpreter that has it")  # fmt: skip
        Path(out_path).write_text(json.dumps({"unavailable": message}))
        sys.exit(MISSING_DEPENDENCY)
    requests = job["requests"]
    n_ctx = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests) + 16
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=n_ctx, n_batch=512, n_threads=job["threads"],
                          n_threads_batch=job["threads"], verbose=False)  # fmt: skip
    result = {"peer": "llama-cpp", "load_s": time.perf_counter() - t0, "threads": job["threads"],
              "dtype": "gguf (as stored)", "versions": {"llama_cpp_python": llama_cpp.__version__}}  # fmt: skip
    if job["mode"] == "throughput":
        t0 = time.perf_counter()
        for k, r in enumerate(requests):
            _generate(llm, r["prompt_token_ids"], r["max_tokens"])
            if (k + 1) % 8 == 0:
                print(
                    f"llama-cpp: {k + 1}/{len(requests)} at {time.perf_counter() - t0:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
        result["elapsed_s"] = time.perf_counter() - t0
        result["batch_size"] = 1
        result["generated_tokens_total"] = sum(r["max_tokens"] for r in requests)
    else:
        prefill, full = [], []
        for i in range(job["warmup_iters"] + job["iters"]):
            t0 = time.perf_counter()
            _generate(llm, requests[2 * i]["prompt_token_ids"], 1)
            t1 = time.perf_counter()
            _generate(llm, requests[2 * i + 1]["prompt_token_ids"], requests[2 * i + 1]["max_tokens"])
            if i >= job["warmup_iters"]:
                prefill.append(t1 - t0)
                full.append(time.perf_counter() - t1)
        result["prefill_s"] = prefill
        result["latency_s"] = full
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
