"""Transformers (torch, CPU, f32) counterpart of `bench/steps.py`: prefill and decode tokens/s at
batch 1 and 32 on the same GGUF. Runs in an interpreter that has torch, transformers, accelerate
and gguf (a peer, never a jaxserve dependency): `python hf_steps.py PATH.gguf`."""

import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

torch.set_num_threads(2)
gguf = sys.argv[1]
m = AutoModelForCausalLM.from_pretrained(
    os.path.dirname(gguf), gguf_file=os.path.basename(gguf), torch_dtype=torch.float32
)
m.eval()


def run(batch):
    ids = torch.randint(3, 40000, (batch, 128))
    with torch.no_grad():
        m(ids)  # warm
        t = time.perf_counter()
        out = m(ids, use_cache=True)
        tp = time.perf_counter() - t
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(32):
            o = m(tok, past_key_values=past, use_cache=True)
            past = o.past_key_values
            tok = o.logits[:, -1:].argmax(-1)
        td = (time.perf_counter() - t) / 32
    print(
        f"transformers batch {batch}: prefill {batch * 128 / tp:.0f} tok/s ({tp * 1e3:.0f} ms for {batch}x128), "
        f"decode {batch / td:.1f} tok/s ({td * 1e3:.1f} ms/step)"
    )


run(1)
run(32)
