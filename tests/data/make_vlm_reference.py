"""Make tests/data/vlm_reference.json: transformers' greedy tokens of the tiny Gemma 3 vision-language model.

Run with the reference venv (torch + transformers + Pillow; not jaxserve dependencies):

    /work/venv-st/bin/python tests/data/make_vlm_reference.py [--jaxserve-python python3]

jaxserve's interpreter draws the tiny model (`checkpoints.tiny_vlm.build_tiny_vlm`, seed 0) and writes
it as a Hugging Face `Gemma3ForConditionalGeneration` directory, with the test images
(`tests/data/vlm_images.py`) as PNG files; transformers loads the directory strictly (a missing or
unexpected weight stops the script), preprocesses the images with Gemma 3's image processor (PIL
backend), expands each `<start_of_image>` with `Gemma3Processor`, and decodes greedily in f32 with
its KV cache (the first forward with `token_type_ids`: bidirectional attention within each image).

JSON format:
{
  "source": {"transformers", "torch", "dtype": "float32"},
  "pixels": {image: {"mean", "corner": pixel_values[0, :, :2, :2]}},
  "image_embeddings": {image: {"sum", "first": the first 8 values of soft token 0}},
  "cases": [{"name", "messages", "images", "prompt_ids", "new_ids", "new_margins"}]
}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import AutoTokenizer, Gemma3ForConditionalGeneration, Gemma3Processor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("vlm_reference.json")
NEW_TOKENS = 16
IMAGES = ("red", "blue", "green")

WRITE = """
import sys
from pathlib import Path
from checkpoints.hf import save_hf_dir
from checkpoints.tiny_vlm import build_tiny_vlm
from tests.data.vlm_images import image_png
model = build_tiny_vlm()
save_hf_dir(model.params, model.config, model.tokenizer_bundle, sys.argv[1] + "/model", vision=model.vision)
for name in sys.argv[2:]:
    Path(sys.argv[1], name + ".png").write_bytes(image_png(name))
"""

# (name, user text with <start_of_image> where each image goes, images)
CASES = [
    ("one_image", "<start_of_image>What is in the picture?", ["red"]),
    ("other_image", "<start_of_image>What is in the picture?", ["blue"]),
    ("two_images", "Compare <start_of_image> with <start_of_image> please.", ["red", "green"]),
    ("image_late", "The quick brown fox jumps over the lazy dog. " * 2 + "Now look: <start_of_image>", ["green"]),
]


def greedy(model, inputs: dict, new_tokens: int) -> tuple[list[int], list[float]]:
    out = model(**inputs, use_cache=True)
    logits, cache, new_ids, margins = out.logits[0, -1], out.cache, [], []
    for _ in range(new_tokens):
        top2 = torch.topk(logits, 2).values
        margins.append(round(float(top2[0] - top2[1]), 5))
        next_id = int(torch.argmax(logits))
        new_ids.append(next_id)
        out = model(input_ids=torch.tensor([[next_id]]), cache=cache, use_cache=True)
        logits, cache = out.logits[0, -1], out.cache
    return new_ids, margins


def load_checked(directory: Path, model_class: type = Gemma3ForConditionalGeneration) -> Any:
    """`model_class` from `directory` in f32, strictly: a missing, unexpected or misshapen weight stops the script
    (make_smolvlm_reference.py loads its model with it too)."""
    model, info = model_class.from_pretrained(str(directory), dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise SystemExit(f"{directory}: weights did not load cleanly: {problems}")
    return model.eval()


def processor_of(directory: Path, model: Gemma3ForConditionalGeneration) -> Gemma3Processor:
    cfg = model.config
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    for attr, token_id in (("boi_token", cfg.boi_token_index), ("eoi_token", cfg.eoi_token_index)):
        setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))
    tokenizer.boi_token_id = cfg.boi_token_index
    tokenizer.image_token = tokenizer.convert_ids_to_tokens(cfg.image_token_index)
    tokenizer.image_token_id = cfg.image_token_index
    size = cfg.vision_config.image_size
    images = Gemma3ImageProcessorPil(size={"height": size, "width": size})
    return Gemma3Processor(images, tokenizer, image_seq_length=cfg.mm_tokens_per_image)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jaxserve-python", default="python3")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        subprocess.run([args.jaxserve_python, "-c", WRITE, tmp, *IMAGES], check=True, env=env, cwd=ROOT)
        model = load_checked(Path(tmp) / "model")
        processor = processor_of(Path(tmp) / "model", model)
        images = {name: Image.open(Path(tmp, name + ".png")).convert("RGB") for name in IMAGES}
        pixels, embeddings = {}, {}
        with torch.no_grad():
            for name, image in images.items():
                values = processor.image_processor(image, return_tensors="pt")["pixel_values"]
                pixels[name] = {"mean": float(values.mean()), "corner": values[0, :, :2, :2].tolist()}
                soft = model.get_image_features(values).pooler_output[0]
                embeddings[name] = {"sum": float(soft.sum()), "first": soft[0, :8].tolist()}
            cases = []
            for name, text, names in CASES:
                messages = [{"role": "user", "content": text}]
                prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                inputs = processor(
                    text=prompt, images=[images[n] for n in names], return_tensors="pt", add_special_tokens=False
                )
                new_ids, margins = greedy(model, dict(inputs), NEW_TOKENS)
                ids = inputs["input_ids"][0].tolist()
                case = {"name": name, "messages": messages, "images": names, "prompt_ids": ids}
                cases.append({**case, "new_ids": new_ids, "new_margins": margins})
    source = {"transformers": transformers.__version__, "torch": torch.__version__, "dtype": "float32"}
    result = {"source": source, "pixels": pixels, "image_embeddings": embeddings, "cases": cases}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {OUT}: {len(cases)} cases; min margin {min(min(c['new_margins']) for c in cases):.4f}")
    print(np.array([c["new_ids"] for c in cases]))


if __name__ == "__main__":
    main()
