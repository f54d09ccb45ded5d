#!/usr/bin/env bash
# GPU check of the Pallas attention kernels, in one command, for a GPU machine with no network
# and a preinstalled jax (0.11.x, CUDA): run it from anywhere as `bash bench/gpu_check.sh`.
#
#   1. the kernel tests (tests/kernels), with the kernels compiled natively, not interpreted;
#   2. the kernel benchmark (bench.kernel_bench): decode GB/s vs a device copy and vs JAX's
#      shipped paged_attention, prefill TFLOP/s vs the reference;
#   3. end-to-end greedy generation with the default model, attention backend pallas vs
#      reference, through `jaxserve.LLM` (needs the engine and the model: the model comes from
#      $JAXSERVE_CACHE or $JAXSERVE_GPU_CHECK_MODEL, a .gguf path, since there is no network);
# then prints a compact table. Each stage has a time limit; all three stay under 8 minutes.
# Logs and JSON go to $GPU_CHECK_OUT (default: a fresh temporary directory).
set -u
cd "$(dirname "$0")/.."
OUT="${GPU_CHECK_OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAXSERVE_PALLAS_INTERPRET="${JAXSERVE_PALLAS_INTERPRET:-0}"  # 1 only for a CPU dry run
# tests/conftest.py defaults JAX_PLATFORMS to cpu; here the GPU must be the default backend.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"
MODEL="${JAXSERVE_GPU_CHECK_MODEL:-smollm2-135m-instruct}"
START=$SECONDS

echo "== 1/3 kernel tests, native (limit 140 s) =="
timeout 140 python3 -m pytest -q -p no:cacheprovider -m "not integration" tests/kernels \
  > "$OUT/tests.log" 2>&1
echo "exit $?" >> "$OUT/tests.log"
tail -n 25 "$OUT/tests.log"

echo "== 2/3 kernel benchmark (limit 190 s) =="
timeout 190 python3 -m bench.kernel_bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"

echo "== 3/3 end-to-end greedy generation, $MODEL (limit 120 s) =="
timeout 120 python3 - "$MODEL" "$OUT/e2e.json" <<'EOF' 2>&1 | tee "$OUT/e2e.log"
import json, sys, time

model, out_path = sys.argv[1], sys.argv[2]
result = {"model": model, "backends": {}}
try:
    from jaxserve import LLM, SamplingParams

    colours = ["red", "blue", "green", "white"]
    prompts = [f"Question {i}: name {i + 2} animals that are {colours[i % 4]}." for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for backend in ("reference", "pallas"):
        t0 = time.perf_counter()
        llm = LLM(model=model, attention_backend=backend, warm_up=False, max_num_seqs=16,
                  max_model_len=512, max_num_batched_tokens=256, dtype="float32")
        first = llm.generate(prompts, params, use_tqdm=False)  # compiles the shapes it meets
        setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = [o.outputs[0].token_ids for o in again]
        result["backends"][backend] = {
            "setup_s": setup, "seconds": seconds, "tokens": tokens,
            "tok_per_s": sum(map(len, tokens)) / seconds,
            "repeatable": tokens == [o.outputs[0].token_ids for o in first],
        }
        print(f"{backend}: {result['backends'][backend]['tok_per_s']:.0f} tok/s (setup {setup:.0f} s): "
              f"{again[0].outputs[0].text[:50]!r}", flush=True)
        del llm
    ref, pal = (result["backends"][b]["tokens"] for b in ("reference", "pallas"))
    result["same_prompts"] = sum(a == b for a, b in zip(ref, pal))
    result["num_prompts"] = len(ref)
except Exception as e:  # reported in the table; the other stages still count
    result["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    print("end-to-end failed:", result["error"], flush=True)
with open(out_path, "w") as f:
    json.dump(result, f)
EOF

echo "== summary ($((SECONDS - START)) s; logs in $OUT) =="
python3 - "$OUT" <<'EOF'
import json, os, re, sys

out = sys.argv[1]


def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None


log = open(os.path.join(out, "tests.log")).read()
counts = re.findall(r"(\d+) (passed|failed|error|errors|skipped)", log)
code = re.findall(r"exit (\d+)", log)
print(f"kernel tests (native): {', '.join(f'{n} {w}' for n, w in counts) or 'no summary'}"
      f"{' (timed out)' if code and code[-1] == '124' else ''}")

bench = load("bench.json")
if bench is None:
    print("kernel benchmark: no result (see bench.log)")
else:
    print(f"kernel benchmark on {bench['device']} ({bench['dtype']}), copy "
          f"{bench['copy_bps'] / 1e9:.0f} GB/s (read + write)")
    print(f"  {'decode case':<26} {'ours us':>8} {'GB/s':>7} {'%copy':>6} {'x jax':>6} {'x ref':>6}")
    for r in bench["rows"]:
        if r["kind"] != "decode":
            continue
        us = f"{1e6 * r['ours_s']:8.1f}" if r.get("ours_s") else "     n/a"
        print(f"  {r['case']:<26} {us} {r.get('ours_gbps', 0):7.0f} {r.get('ours_pct_copy', 0):6.1f} "
              f"{r.get('speedup_vs_shipped', float('nan')):6.2f} {r.get('speedup_vs_reference', float('nan')):6.2f}")
    for r in bench["rows"]:
        if r["kind"] == "prefill":
            print(f"  {r['case']:<34} {r.get('ours_tflops', 0):6.1f} TFLOP/s, "
                  f"x ref {r.get('speedup_vs_reference', float('nan')):.2f}")

e2e = load("e2e.json")
if e2e is None or "error" in (e2e or {}):
    print(f"end-to-end: {'no result' if e2e is None else e2e['error']}")
else:
    b = e2e["backends"]
    print(f"end-to-end {e2e['model']}: reference {b['reference']['tok_per_s']:.0f} tok/s, "
          f"pallas {b['pallas']['tok_per_s']:.0f} tok/s; same greedy tokens on "
          f"{e2e['same_prompts']}/{e2e['num_prompts']} prompts")
EOF
