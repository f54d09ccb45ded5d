"""Peer helper: write a Hugging Face model directory (safetensors, config, tokenizer with its chat
template) from a GGUF file, for peers that load only such directories (vLLM).

Standalone script (imports no jaxserve code), run by `bench.peers.runner` in any interpreter that
has torch, transformers, accelerate and gguf:

    python gguf_to_hf.py JOB.json OUT.json

JOB: {"gguf": path, "out_dir": path}. transformers dequantizes the GGUF's tensors to f32 on load;
its quantizer and `quantization_config` are dropped before saving, so the directory holds plain
f32 weights (a reader would otherwise look for the quantizer). OUT: {"out_dir", "transformers"}.
Exit code 3, and {"unavailable": message} in OUT, when a dependency is missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MISSING_DEPENDENCY = 3


def main(job_path: str, out_path: str) -> None:
    try:
        import accelerate  # noqa: F401  (transformers needs it to load GGUF files)
        import gguf  # noqa: F401
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        message = (f"converting the GGUF for the peer needs torch, transformers, accelerate and gguf in "
                   f"{sys.executable} ({e}); install them there, pass --peer-convert-python with an interpreter "
                   f"that has them, or give a Hugging Face directory with --peer-model DIR")  # fmt: skip
        Path(out_path).write_text(json.dumps({"unavailable": message}))
        sys.exit(MISSING_DEPENDENCY)
    job = json.loads(Path(job_path).read_text())
    gguf_file, out_dir = Path(job["gguf"]), Path(job["out_dir"])
    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name).save_pretrained(out_dir)
    Path(out_path).write_text(json.dumps({"out_dir": str(out_dir), "transformers": transformers.__version__}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
