"""Make tests/data/smolvlm_reference.json: transformers' greedy tokens of the tiny SmolVLM.

Run with the reference venv (torch + transformers + Pillow; not jaxserve dependencies):

    /work/venv-st/bin/python tests/data/make_smolvlm_reference.py [--jaxserve-python python3]

jaxserve's interpreter draws the tiny model (`checkpoints.tiny_smolvlm.build_tiny_smolvlm`, seed 0)
and writes it as a Hugging Face `SmolVLMForConditionalGeneration` directory (with its
`preprocessor_config.json`), with the test images (`tests/data/vlm_images.py`) as PNG files;
transformers loads the directory strictly (a missing or unexpected weight stops the script),
splits and preprocesses the images with `SmolVLMImageProcessorPil` from that file, expands each
`<image>` with `processing_smolvlm.get_image_prompt_string` (the processor's own expansion; the
processor class itself needs `num2words`), and decodes greedily in f32 with its KV cache.

JSON format:
{
  "source": {"transformers", "torch", "dtype": "float32"},
  "pixels": {image: {"rows", "cols", "tiles", "mean", "corners": pixel_values[tile, :, :2, :2] of
             the first and the global tile}},
  "image_embeddings": {image: {"sum", "first": the first 8 values of token 0 of the first tile and
                       of the global tile}},
  "cases": [{"name", "messages", "images", "prompt_ids", "new_ids", "new_margins"}],
  "unsplit": {image: {"mean", "corner": pixel_values[0, :, :2, :2]}}: `do_image_splitting` false
}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import make_vlm_reference
import numpy as np
import torch
import transformers
from make_vlm_reference import greedy, load_checked  # this folder: the script's own directory is on sys.path
from PIL import Image
from transformers import AutoTokenizer, SmolVLMForConditionalGeneration
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("smolvlm_reference.json")
NEW_TOKENS = 16
IMAGES = make_vlm_reference.IMAGES

# make_vlm_reference's writer and cases, for the tiny SmolVLM and its `<image>` placeholder.
WRITE = make_vlm_reference.WRITE.replace("tiny_vlm", "tiny_smolvlm")
CASES = [(name, text.replace("<start_of_image>", "<image>"), images) for name, text, images in make_vlm_reference.CASES]


def prompt_text(text: str, rows: list[int], cols: list[int], seq_len: int) -> str:
    pieces = text.split("<image>")
    out = pieces[0]
    for r, c, piece in zip(rows, cols, pieces[1:]):
        out += get_image_prompt_string(r, c, seq_len, "<fake_token_around_image>", "<image>", "<global-img>") + piece
    return out


def image_records(model, processor, images: dict) -> tuple[dict, dict]:
    pixels, embeddings = {}, {}
    for name, image in images.items():
        batch = processor([[image]], return_tensors="pt", return_row_col_info=True)
        values = batch["pixel_values"][0]
        rows, cols = batch["rows"][0][0], batch["cols"][0][0]
        corners = [values[i, :, :2, :2].tolist() for i in (0, -1)]
        pixels[name] = {
            "rows": rows,
            "cols": cols,
            "tiles": len(values),
            "mean": float(values.mean()),
            "corners": corners,
        }
        out = model.get_image_features(batch["pixel_values"], batch["pixel_attention_mask"]).pooler_output[0]
        seq = out.shape[0] // len(values)
        first = [out[i * seq, :8].tolist() for i in (0, len(values) - 1)]
        embeddings[name] = {"sum": float(out.sum()), "first": first}
    return pixels, embeddings


def run_case(model, tokenizer, processor, images: dict, text: str, names: list[str]) -> dict:
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    batch = processor([[images[n] for n in names]], return_tensors="pt", return_row_col_info=True)
    seq_len = model.model.image_seq_len
    ids = tokenizer(prompt_text(rendered, batch["rows"][0], batch["cols"][0], seq_len), add_special_tokens=False)
    inputs = {
        "input_ids": torch.tensor([ids["input_ids"]]),
        "pixel_values": batch["pixel_values"],
        "pixel_attention_mask": batch["pixel_attention_mask"],
    }
    new_ids, margins = greedy(model, inputs, NEW_TOKENS)
    return {
        "messages": messages,
        "images": names,
        "prompt_ids": ids["input_ids"],
        "new_ids": new_ids,
        "new_margins": margins,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jaxserve-python", default="python3")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        subprocess.run([args.jaxserve_python, "-c", WRITE, tmp, *IMAGES], check=True, env=env, cwd=ROOT)
        directory = Path(tmp) / "model"
        model = load_checked(directory, SmolVLMForConditionalGeneration)
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        settings = json.loads((directory / "preprocessor_config.json").read_text())
        settings.pop("image_processor_type")
        processor = SmolVLMImageProcessorPil(**settings)
        images = {name: Image.open(Path(tmp, name + ".png")).convert("RGB") for name in IMAGES}
        unsplit = {}
        for name, image in images.items():
            values = processor([[image]], do_image_splitting=False, return_tensors="pt")["pixel_values"][0]
            unsplit[name] = {"mean": float(values.mean()), "corner": values[0, :, :2, :2].tolist()}
        with torch.no_grad():
            pixels, embeddings = image_records(model, processor, images)
            cases = [
                {"name": name, **run_case(model, tokenizer, processor, images, text, names)}
                for name, text, names in CASES
            ]
    source = {"transformers": transformers.__version__, "torch": torch.__version__, "dtype": "float32"}
    result = {"source": source, "pixels": pixels, "image_embeddings": embeddings, "cases": cases, "unsplit": unsplit}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {OUT}: {len(cases)} cases; min margin {min(min(c['new_margins']) for c in cases):.4f}")
    print(np.array([c["new_ids"] for c in cases]))
    print({n: (p["rows"], p["cols"], len(c)) for (n, p), c in zip(pixels.items(), [x["prompt_ids"] for x in cases])})


if __name__ == "__main__":
    main()
