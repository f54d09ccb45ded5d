"""Figures of images in prompts, offline on one engine: the vision encoder's time per image (1, 2
and 4 images per call), and the time to first token of prompts with 1, 2 and 4 images against
text-only prompts of the same token count (each image new: no encoder cache or prefix cache hit),
and of a second turn about the same image (encoder cache hit) against one about a new image.

    python3 -m bench.vision_ttft [--repeats N] [--model gemma3|smolvlm]

It runs a tiny random vision-language model (Gemma 3: `checkpoints.tiny_vlm`; SmolVLM:
`checkpoints.tiny_smolvlm`, whose 48x48 pictures take 3 x 3 tiles and a global one) on the default
JAX device; an "image" is one picture (SmolVLM: all its tiles, encoded 4 a call); times are
medians of `--repeats` runs, and ratios against the text-only prompt of the same length measured
in the same run (the only numbers to compare across machines).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np
from PIL import Image

from checkpoints.tiny_smolvlm import build_tiny_smolvlm
from checkpoints.tiny_vlm import build_tiny_vlm
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.image_prompt import MultimodalPrompt
from jaxserve.images import ImageInput
from jaxserve.sampling_params import SamplingParams
from jaxserve.vision_inputs import Picture, expand_pictures, load_picture

ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=128,
    max_model_len=256,
    block_size=8,
    num_blocks=128,
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(128,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(32,),
)
MODELS = {"gemma3": build_tiny_vlm, "smolvlm": build_tiny_smolvlm}
# SmolVLM's four pictures take 4 x 10 tiles of 4 tokens and their markers: longer prompts.
LONGER = dict(max_model_len=512, num_blocks=256, block_table_buckets=(64,))
QUESTION = "Describe what you see."


class _Images:
    """A new random picture at every call (so no cache holds it)."""

    def __init__(self, vision) -> None:
        self.vision, self.rng = vision, np.random.default_rng(0)

    def __call__(self) -> Picture:
        out = io.BytesIO()
        Image.fromarray(self.rng.integers(0, 256, (48, 48, 3), dtype=np.uint8), "RGB").save(out, format="PNG")
        return load_picture(out.getvalue(), self.vision, 1 << 20)


def tower_inputs(pictures: list[Picture]) -> list[ImageInput]:
    """The encoder's inputs of pictures: each one, or each tile of it."""
    return [t for p in pictures for t in (p.tiles if hasattr(p, "tiles") else (p,))]


def ttft(engine: LLMEngine, prompt, name: str) -> float:
    """Seconds from adding the request to its first token."""
    t0 = time.perf_counter()
    engine.add_request(name, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def image_prompt(engine: LLMEngine, images: list, text: str = QUESTION) -> MultimodalPrompt:
    placeholder = engine.tokenizer.decode([engine.vision.placeholder_token_id], skip_special_tokens=False)
    content = placeholder * len(images) + text
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return expand_pictures(rendered, images, engine.tokenizer, engine.vision)


def text_prompt(engine: LLMEngine, length: int, salt: int) -> list[int]:
    """Token ids of a text prompt of `length` tokens, unlike any other (its first token varies)."""
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)
    return [10 + salt % 200, *ids[: length - 1]]


def measure(engine: LLMEngine, repeats: int) -> list[dict]:
    new_image = _Images(engine.vision)
    rows, n = [], 0
    for count in (1, 2, 4):
        per_call = []
        for _ in range(repeats):
            inputs = tower_inputs([new_image() for _ in range(count)])
            t0 = time.perf_counter()
            for i in range(0, len(inputs), 4):
                engine.runner.vision.encode(inputs[i : i + 4])
            per_call.append(time.perf_counter() - t0)
        image_s, text_s = [], []
        for _ in range(repeats):
            prompt = image_prompt(engine, [new_image() for _ in range(count)])
            image_s.append(ttft(engine, prompt, f"image-{n}"))
            text_s.append(ttft(engine, text_prompt(engine, len(prompt.token_ids), n), f"text-{n}"))
            n += 1
        rows.append(
            {
                "images": count,
                "prompt_tokens": len(prompt.token_ids),
                "encoder_ms_per_image": 1e3 * statistics.median(per_call) / count,
                "ttft_image_ms": 1e3 * statistics.median(image_s),
                "ttft_text_ms": 1e3 * statistics.median(text_s),
            }
        )
        rows[-1]["image_over_text"] = rows[-1]["ttft_image_ms"] / rows[-1]["ttft_text_ms"]
    return rows


def second_turn(engine: LLMEngine, repeats: int) -> dict:
    """TTFT of a turn about an image already encoded (another question: no prefix hit past the
    image's text) against the same turn about a new image."""
    new_image = _Images(engine.vision)
    hit, miss = [], []
    for i in range(repeats):
        seen = new_image()
        ttft(engine, image_prompt(engine, [seen]), f"first-{i}")
        hit.append(ttft(engine, image_prompt(engine, [seen], f"Question {i}: what colour?"), f"hit-{i}"))
        miss.append(ttft(engine, image_prompt(engine, [new_image()], f"Question {i}: what colour?"), f"miss-{i}"))
    return {"ttft_cached_image_ms": 1e3 * statistics.median(hit), "ttft_new_image_ms": 1e3 * statistics.median(miss)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", choices=sorted(MODELS), default="gemma3")
    args = parser.parse_args(argv)
    settings = {**ENGINE, **(LONGER if args.model == "smolvlm" else {})}
    engine = LLMEngine(MODELS[args.model](), EngineConfig(**settings, enable_prefix_caching=False))
    engine.warm_up()
    rows = measure(engine, args.repeats)
    print("| images | prompt tokens | encoder ms/image | TTFT images ms | TTFT text ms | images/text |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['images']} | {r['prompt_tokens']} | {r['encoder_ms_per_image']:.2f} | {r['ttft_image_ms']:.1f} | "
            f"{r['ttft_text_ms']:.1f} | {r['image_over_text']:.2f} |"
        )
    turn = second_turn(engine, args.repeats)
    cached, new = turn["ttft_cached_image_ms"], turn["ttft_new_image_ms"]
    print(f"second turn about an image: cached (encoder cache hit) {cached:.1f} ms, new image {new:.1f} ms")
    return rows + [turn]


if __name__ == "__main__":
    main()
