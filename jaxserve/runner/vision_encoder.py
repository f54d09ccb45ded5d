"""The vision encoder of a vision-language model's runner: its declared program, compiled per
image-count bucket at warm-up, and the encoder cache (an image here is one square input of the
tower: a Gemma 3 image, or one tile of an Idefics3 / SmolVLM image).

An iteration's prefill chunks that hold rows of an image need its soft-token embeddings before
their inputs are built (`encode_step`): an image already in the encoder cache (by its pixels'
digest) is not encoded again; the others are encoded together, padded to an image-count bucket,
and read back to the host, where `StepInputs` places them at their rows. The cache keeps the
embeddings of the `capacity` images used last (least recently used out first).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from checkpoints.loaded import VisionTower
from jaxserve.config import bucket_for
from jaxserve.images import ImageInput
from jaxserve.model.vision import image_embeddings
from jaxserve.runner.image_inputs import EncoderCache
from jaxserve.runner.placement import cast_params
from jaxserve.scheduler.output import ScheduledChunk
from sharding.rules import replicated

logger = logging.getLogger(__name__)

IMAGE_BUCKETS = (1, 2, 4)  # images per call of the encoder program
ENCODER_CACHE_IMAGES = 256


class VisionEncoder:
    """The vision tower on the runner's (one-device) mesh, its compiled program and its cache."""

    def __init__(
        self, tower: VisionTower, dtype: Any, mesh: Mesh, step_tokens: int, capacity: int = ENCODER_CACHE_IMAGES
    ) -> None:
        if mesh.size > 1:
            raise ValueError("images are served on one device only (no tensor, pipeline or expert parallelism)")
        bidirectional = tower.config.bidirectional_images
        if bidirectional and step_tokens < tower.config.mm_tokens_per_image:  # an image is prefilled in one step
            raise ValueError(
                f"max_num_batched_tokens ({step_tokens}) must hold an image's "
                f"{tower.config.mm_tokens_per_image} tokens: a prefill chunk never splits an image"
            )
        self.config = tower.config
        self.params = jax.device_put(cast_params(tower.params, jnp.dtype(dtype)), replicated(mesh))
        self.cache = EncoderCache(capacity, tower.config.text_hidden_size, bidirectional)
        self._jitted = jax.jit(image_embeddings, static_argnums=0)
        self._compiled: dict[int, Any] = {}
        self.num_compilations = 0

    def _pixels(self, count: int) -> jax.ShapeDtypeStruct:
        size = self.config.image_size
        return jax.ShapeDtypeStruct((count, 3, size, size), jnp.float32)

    def _program(self, bucket: int, warming_up: bool = False) -> Any:
        exe = self._compiled.get(bucket)
        if exe is None:
            if not warming_up:
                logger.warning("compiling a new vision encoder variant at serving time: %d images", bucket)
            exe = self._compiled[bucket] = self._jitted.lower(self.config, self.params, self._pixels(bucket)).compile()
            self.num_compilations += 1
        return exe

    def warm_up(self) -> None:
        for bucket in IMAGE_BUCKETS:
            self._program(bucket, warming_up=True)

    def encode_step(self, prefills: list[ScheduledChunk]) -> None:
        """Put in the encoder cache the soft-token embeddings of every image some rows of these
        prefill chunks hold (encoding those it lacks), for `StepInputs` to read."""
        wanted = {}
        for c in prefills:
            for image in c.request.images:
                if image.start < c.start + c.num_new_tokens and c.start < image.end:
                    wanted[image.image.digest] = image.image
        if len(wanted) > self.cache.capacity:
            raise ValueError(f"a step holds {len(wanted)} images; the encoder cache keeps {self.cache.capacity}")
        missing = [image for digest, image in wanted.items() if self.cache.get(digest) is None]
        self.cache.hits += len(wanted) - len(missing)
        self.cache.misses += len(missing)
        most = IMAGE_BUCKETS[-1]
        for batch in (missing[i : i + most] for i in range(0, len(missing), most)):
            for image, embeddings in zip(batch, self.encode(batch)):
                self.cache.put(image.digest, embeddings)

    def encode(self, images: list[ImageInput]) -> np.ndarray:
        """Soft-token embeddings [len(images), mm_tokens_per_image, E] of at most IMAGE_BUCKETS[-1] images."""
        bucket = bucket_for(len(images), IMAGE_BUCKETS)
        pixels = np.zeros(self._pixels(bucket).shape, np.float32)
        for i, image in enumerate(images):
            pixels[i] = image.pixels
        return np.asarray(self._program(bucket)(self.params, pixels))[: len(images)]
