"""Stage `vision_encoder`: Gemma 3 4B's vision tower (`shapes.GEMMA3_4B_TOWER`: SigLIP, 27 layers of
1152 features over 4096 patches of an 896-pixel image, pooled to 256 soft tokens, projected to 2560
features; the dry run: the tiny test tower) with random weights made on the device in the plan's
engine dtype, served as the runner serves it (`jaxserve.runner.vision_encoder.VisionEncoder`: f32
compute, one compiled program per image-count bucket, compiled at warm-up).

- Correctness: the served program against a float64 numpy forward of the same weights
  (`reference_embeddings`) on a small input: the tower's width and heads, 2 layers, 224-pixel images
  (256 patches pooled to 16 soft tokens), 2 images. A difference past `BOUND` fails the stage.
- Time, per bucket of 1, 2 and 4 images: ms per call of `VisionEncoder.encode` (pixels in, soft tokens
  back on the host, as a prefill step waits for them), ms per image and the tower's TFLOP/s. Nothing
  may compile after warm-up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench import kernel_bench
from bench.gpu_check.plan import Plan, Stage
from bench.gpu_check.record import StageRecord
from bench.gpu_check.shapes import GEMMA3_4B_TOWER
from checkpoints.architectures import gemma3_vision
from checkpoints.loaded import VisionTower
from checkpoints.tiny_vlm import TINY_TOWER
from checkpoints.weights import device_initializer
from jaxserve.images import ImageInput
from jaxserve.runner.vision_encoder import IMAGE_BUCKETS, VisionEncoder
from sharding.mesh import make_mesh
from sharding.rules import replicated

BOUND = 1e-3  # relative to the reference's largest output: f32 against f64, over 2 layers
# Gemma 3's image marker ids (`gemma3_vision.from_hf` defaults): unused by the tower, part of its config.
_MARKERS = dict(boi_token_id=255999, eoi_token_id=256000, image_token_id=262144)


def tower_config(dry_run: bool) -> gemma3_vision.VisionConfig:
    """Gemma 3 4B's tower, or (dry run) the tiny test models' tower projecting to 64 features."""
    shape = dict(**TINY_TOWER, mm_tokens_per_image=16, text_hidden_size=64) if dry_run else GEMMA3_4B_TOWER
    return gemma3_vision.VisionConfig(**shape, **_MARKERS)


def check_config(v: gemma3_vision.VisionConfig) -> gemma3_vision.VisionConfig:
    """The correctness check's smaller tower: the same width and heads, 2 layers, 16x16 patches (or
    fewer), pooled to 16 soft tokens."""
    side = min(v.patches_per_side, 16)
    return dataclasses.replace(
        v, num_layers=min(v.num_layers, 2), image_size=side * v.patch_size, mm_tokens_per_image=16
    )


def tower_flops(v: gemma3_vision.VisionConfig) -> float:
    """Multiply-adds x 2 of one image through the tower and projector (matmuls and attention only)."""
    n, c, f = v.num_patches, v.hidden_size, v.intermediate_size
    layer = 2 * n * (4 * c * c + 2 * c * f) + 4 * n * n * c
    return 2 * n * 3 * v.patch_size**2 * c + v.num_layers * layer + 2 * v.mm_tokens_per_image * c * v.text_hidden_size


def random_encoder(v: gemma3_vision.VisionConfig, dtype: str, seed: int = 0) -> VisionEncoder:
    """The served encoder of tower `v` with random weights drawn on the first device."""
    mesh = make_mesh(devices=jax.devices()[:1])
    init = device_initializer(gemma3_vision.weights(v), jnp.dtype(dtype), seed)
    params = jax.block_until_ready(jax.jit(init, out_shardings=replicated(mesh))())
    return VisionEncoder(VisionTower(v, params), dtype, mesh, v.mm_tokens_per_image)


def random_images(v: gemma3_vision.VisionConfig, count: int, seed: int) -> list[ImageInput]:
    rng = np.random.default_rng(seed)
    return [ImageInput.of(rng.uniform(-1, 1, (3, v.image_size, v.image_size))) for _ in range(count)]


def _layer_norm(x: np.ndarray, norm: dict[str, np.ndarray], eps: float) -> np.ndarray:
    centred = x - x.mean(-1, keepdims=True)
    return centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps) * norm["scale"] + norm["bias"]


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def reference_embeddings(v: gemma3_vision.VisionConfig, params: Any, pixels: np.ndarray) -> np.ndarray:
    """Soft tokens [B, mm_tokens_per_image, E] in float64 numpy: the patch embedding as a strided
    convolution, pre-norm layers one head at a time, the post norm, average pooling, RMS norm, projection."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    b, s, k, c = pixels.shape[0], v.patches_per_side, v.patch_size, v.hidden_size
    conv = p["patch_embed"]["kernel"].reshape(3, k, k, c)
    grid = pixels.astype(np.float64).reshape(b, 3, s, k, s, k)
    h = np.einsum("bcipjq,cpqo->bijo", grid, conv).reshape(b, s * s, c) + p["patch_embed"]["bias"]
    h = h + p["position_embed"]["embedding"]
    for i in range(v.num_layers):
        layer = jax.tree.map(lambda a, i=i: a[i], p["layers"])
        x = _layer_norm(h, layer["attn_norm"], v.layer_norm_eps)
        q, key, val = (x @ layer[n]["kernel"] + layer[n]["bias"] for n in ("q_proj", "k_proj", "v_proj"))
        heads = []
        for j in range(v.num_heads):
            cut = slice(j * v.head_dim, (j + 1) * v.head_dim)
            scores = q[..., cut] @ key[..., cut].transpose(0, 2, 1) / np.sqrt(v.head_dim)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append(weights / weights.sum(-1, keepdims=True) @ val[..., cut])
        h = h + np.concatenate(heads, -1) @ layer["o_proj"]["kernel"] + layer["o_proj"]["bias"]
        x = _layer_norm(h, layer["mlp_norm"], v.layer_norm_eps)
        h = h + _gelu_tanh(x @ layer["fc1"]["kernel"] + layer["fc1"]["bias"]) @ layer["fc2"]["kernel"]
        h = h + layer["fc2"]["bias"]
    h = _layer_norm(h, p["post_norm"], v.layer_norm_eps)
    t = round(v.mm_tokens_per_image**0.5)
    pooled = h.reshape(b, t, s // t, t, s // t, c).mean(axis=(2, 4)).reshape(b, t * t, c)
    normed = pooled / np.sqrt((pooled**2).mean(-1, keepdims=True) + v.layer_norm_eps) * p["projector"]["norm"]["scale"]
    return normed @ p["projector"]["kernel"]


def check(v: gemma3_vision.VisionConfig, dtype: str) -> dict:
    """The served program against the float64 reference, on `check_config(v)` and 2 images."""
    small = check_config(v)
    encoder = random_encoder(small, dtype, seed=1)
    encoder.warm_up()
    images = random_images(small, 2, seed=2)
    got = encoder.encode(images)
    want = reference_embeddings(small, encoder.params, np.stack([i.pixels for i in images]))
    err = float(np.max(np.abs(got - want)))
    bound = BOUND * max(1.0, float(np.max(np.abs(want))))
    shape = f"{small.num_layers} layers, {small.num_patches} patches -> {small.mm_tokens_per_image} tokens"
    return {"check": "served encoder vs float64 numpy", "shape": shape, "max_err": err, "bound": bound}


def run(plan: Plan, stage: Stage, record: StageRecord) -> None:
    v = tower_config(plan.dry_run)
    dtype = plan.engine_dtype
    record.info(tower=v.to_dict(), dtype=dtype, device=jax.devices()[0].device_kind, flops_per_image=tower_flops(v))
    correctness = check(v, dtype)
    record.info(correctness=correctness)
    if not correctness["max_err"] <= correctness["bound"]:
        record.problem(f"the served encoder differs from the reference by {correctness['max_err']:.3g}")
    encoder = random_encoder(v, dtype)
    encoder.warm_up()
    compiled = encoder.num_compilations
    record.info(compilations_at_warm_up=compiled)
    iters = max(1, plan.iters // 10)  # a real-shape call takes ~0.1 s per image
    for count in IMAGE_BUCKETS:
        images = random_images(v, count, seed=count)
        seconds = kernel_bench.time_call(lambda images=images: encoder.encode(images), iters)
        record.row(
            {
                "images": count,
                "ms_per_call": 1e3 * seconds,
                "ms_per_image": 1e3 * seconds / count,
                "tflops": tower_flops(v) * count / seconds / 1e12,
            }
        )
    after = encoder.num_compilations - compiled
    record.info(compilations_after_warm_up=after)
    if after:
        record.problem(f"the encoder compiled {after} programs after warm-up")
