"""Figures of images in prompts, offline on one engine: the time to first token of prompts with 1,
2 and 4 images against text-only prompts of the same token count (each image new: no encoder cache
or prefix cache hit) and the vision encoder's time per image within them (the engine's encoder calls:
1, 2 or 4 images a call), and of a second turn about the same image (encoder cache hit) against one
about a new image.

    python3 -m bench.vision_ttft [--repeats N] [--model gemma3|smolvlm] [--real-shape]

It runs a tiny random vision-language model (Gemma 3: `checkpoints.tiny_vlm`; SmolVLM:
`checkpoints.tiny_smolvlm`, whose 48x48 pictures take 3 x 3 tiles and a global one) on the default
JAX device; an "image" is one picture (SmolVLM: all its tiles, encoded 4 a call). `--real-shape`
(Gemma 3 only): Gemma 3 4B's vision tower at its real shape (`shapes.GEMMA3_4B_TOWER`: 896-pixel
images, 4096 patches, 256 soft tokens) with random weights, projecting into a random text model of
Gemma 3 270M's shape (the 4B text model, 4.3B parameters, is too large for a CPU's f32 figures),
with the tiny model's tokenizer. Times are medians of `--repeats` runs, and ratios against the
text-only prompt of the same length measured in the same run (the only numbers to compare across
machines).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import statistics
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from bench.gpu_check.random_model import random_params_on_device
from bench.gpu_check.shapes import GEMMA3_4B_TOWER, GEMMA3_270M
from checkpoints.architectures import gemma3_vision
from checkpoints.config import ModelConfig
from checkpoints.loaded import LoadedModel, VisionTower
from checkpoints.tiny_smolvlm import build_tiny_smolvlm
from checkpoints.tiny_vlm import build_tiny_vlm
from checkpoints.weights import device_initializer
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
# --real-shape: 262 tokens an image (4 images: ~1080), a step of up to 1024 (two images' tokens and more),
# one image encoded a step (the scheduler's encoder budget): an image's attention scores and weights in
# the f32 tower take ~2 GB on XLA:CPU, 4 images at once ~9 GB, more than a shared 23 GB machine had free
# (the kernel killed such a run), so a prompt's images are encoded one a step.
REAL_SHAPE = dict(
    max_num_encoder_images=1,
    max_num_seqs=2,
    max_num_batched_tokens=1024,
    max_model_len=1280,
    block_size=16,
    num_blocks=96,
    decode_batch_buckets=(2,),
    sampler_row_buckets=(2,),
    prefill_token_buckets=(512, 1024),
    prefill_seq_buckets=(2,),
    block_table_buckets=(80,),
)
QUESTION = "Describe what you see."


class _Images:
    """A new random picture at every call (so no cache holds it; another `seed` for another series)."""

    def __init__(self, vision, seed: int) -> None:
        self.vision, self.rng = vision, np.random.default_rng(seed)

    def __call__(self) -> Picture:
        out = io.BytesIO()
        Image.fromarray(self.rng.integers(0, 256, (48, 48, 3), dtype=np.uint8), "RGB").save(out, format="PNG")
        return load_picture(out.getvalue(), self.vision, 1 << 20)


def paired_vlm(text: ModelConfig, tower: dict[str, Any]) -> LoadedModel:
    """A Gemma 3 vision-language model of random weights: a text model shaped `text`, a vision tower
    shaped `tower` (`gemma3_vision.VisionConfig` fields; its projector into the text model's features),
    the tiny model's tokenizer, chat template and image markers."""
    tiny = build_tiny_vlm()
    config = dataclasses.replace(text, bos_token_id=tiny.config.bos_token_id, eos_token_ids=tiny.config.eos_token_ids)
    vision = dataclasses.replace(tiny.vision.config, **{**tower, "text_hidden_size": config.hidden_size})
    tower_params = jax.jit(device_initializer(gemma3_vision.weights(vision), jnp.float32))()
    params = random_params_on_device(config, "float32", None)
    return LoadedModel(config, params, tiny.tokenizer_bundle, VisionTower(vision, tower_params))


class EncoderClock:
    """Seconds in the engine's vision encoder calls (it wraps `VisionEncoder.encode`)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        self._encode = engine.runner.vision.encode
        engine.runner.vision.encode = self._timed

    def _timed(self, images: list[ImageInput]) -> np.ndarray:
        t0 = time.perf_counter()
        out = self._encode(images)
        self.seconds += time.perf_counter() - t0
        return out

    def take(self) -> float:
        """Seconds spent encoding since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


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
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * length)
    return [10 + salt % 200, *ids[: length - 1]]


def measure(engine: LLMEngine, repeats: int, clock: EncoderClock) -> Iterator[dict]:
    """A row per image count (1, 2, 4), as each is measured."""
    new_image = _Images(engine.vision, seed=0)
    n = 0
    for count in (1, 2, 4):
        image_s, text_s, encoder_s = [], [], []
        for _ in range(repeats):
            prompt = image_prompt(engine, [new_image() for _ in range(count)])
            clock.take()
            image_s.append(ttft(engine, prompt, f"image-{n}"))
            encoder_s.append(clock.take() / count)
            text_s.append(ttft(engine, text_prompt(engine, len(prompt.token_ids), n), f"text-{n}"))
            n += 1
        row = {
            "images": count,
            "prompt_tokens": len(prompt.token_ids),
            "encoder_ms_per_image": 1e3 * statistics.median(encoder_s),
            "ttft_image_ms": 1e3 * statistics.median(image_s),
            "ttft_text_ms": 1e3 * statistics.median(text_s),
        }
        row["image_over_text"] = row["ttft_image_ms"] / row["ttft_text_ms"]
        row["encoder_share"] = count * row["encoder_ms_per_image"] / row["ttft_image_ms"]
        yield row


def second_turn(engine: LLMEngine, repeats: int) -> dict:
    """TTFT of a turn about an image already encoded (another question: no prefix hit past the
    image's text) against the same turn about a new image (pictures unlike `measure`'s, which the
    encoder cache holds)."""
    new_image = _Images(engine.vision, seed=1)
    hit, miss = [], []
    for i in range(repeats):
        seen = new_image()
        ttft(engine, image_prompt(engine, [seen]), f"first-{i}")
        hit.append(ttft(engine, image_prompt(engine, [seen], f"Question {i}: what colour?"), f"hit-{i}"))
        miss.append(ttft(engine, image_prompt(engine, [new_image()], f"Question {i}: what colour?"), f"miss-{i}"))
    cached, new = 1e3 * statistics.median(hit), 1e3 * statistics.median(miss)
    return {"ttft_cached_image_ms": cached, "ttft_new_image_ms": new, "cached_over_new": cached / new}


def run(model: LoadedModel, settings: dict[str, Any], repeats: int) -> list[dict]:
    """The figures of `model` on an engine of `settings` (prefix caching off), printed as tables."""
    engine = LLMEngine(model, EngineConfig(**settings, enable_prefix_caching=False))
    engine.warm_up()
    print("| images | prompt tokens | encoder ms/image | TTFT images ms | TTFT text ms | images/text | encoder share |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    rows = []
    for r in measure(engine, repeats, EncoderClock(engine)):
        rows.append(r)
        print(
            f"| {r['images']} | {r['prompt_tokens']} | {r['encoder_ms_per_image']:.2f} | {r['ttft_image_ms']:.1f} | "
            f"{r['ttft_text_ms']:.1f} | {r['image_over_text']:.2f} | {r['encoder_share']:.2f} |",
            flush=True,
        )
    turn = second_turn(engine, repeats)
    cached, new = turn["ttft_cached_image_ms"], turn["ttft_new_image_ms"]
    print(
        f"second turn about an image: cached (encoder cache hit) {cached:.1f} ms, new image {new:.1f} ms "
        f"(cached / new {turn['cached_over_new']:.2f})"
    )
    return rows + [turn]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", choices=sorted(MODELS), default="gemma3")
    parser.add_argument(
        "--real-shape",
        action="store_true",
        help="Gemma 3 4B's vision tower at its real shape (random weights) with Gemma 3 270M's text shape",
    )
    args = parser.parse_args(argv)
    if args.real_shape and args.model != "gemma3":
        parser.error("--real-shape is Gemma 3's (its 4B vision tower)")
    if args.real_shape:
        return run(paired_vlm(GEMMA3_270M, GEMMA3_4B_TOWER), REAL_SHAPE, args.repeats)
    return run(MODELS[args.model](), {**ENGINE, **(LONGER if args.model == "smolvlm" else {})}, args.repeats)


if __name__ == "__main__":
    main()
