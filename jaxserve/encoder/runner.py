"""The encoder's compiled programs: `pooled_outputs` (`jaxserve.model.encoder`) for every
(rows, tokens) bucket, compiled ahead of time at warm-up, so serving compiles nothing."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.encoders.config import EncoderConfig
from jaxserve.encoder.batcher import EncoderBuckets, EncoderRequest
from jaxserve.model.encoder import pooled_outputs

logger = logging.getLogger(__name__)


class EncoderRunner:
    def __init__(self, config: EncoderConfig, params: Any, buckets: EncoderBuckets) -> None:
        self.config = config
        self.buckets = buckets
        self.params = jax.device_put(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params))
        self._program = jax.jit(functools.partial(pooled_outputs, config))
        self.compiled: dict[tuple[int, int], Any] = {}
        self.num_compilations = 0

    def bucket_summary(self) -> str:
        shapes = self.buckets.all()
        return f"{len(shapes)} encoder shapes (rows x tokens): " + ", ".join(f"{r}x{t}" for r, t in shapes)

    def _lower(self, rows: int, tokens: int) -> Any:
        ids = jax.ShapeDtypeStruct((rows, tokens), jnp.int32)
        lengths = jax.ShapeDtypeStruct((rows,), jnp.int32)
        weights = jax.ShapeDtypeStruct((rows, tokens), jnp.float32)
        return self._program.lower(self.params, ids, lengths, weights)

    def warm_up(self) -> float:
        """Compile every bucket (lowered here, compiled on a thread per core)."""
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            pending = {shape: pool.submit(self._lower(*shape).compile) for shape in self.buckets.all()}
            for shape, future in pending.items():
                self.compiled[shape] = future.result()
        self.num_compilations += len(pending)
        return time.perf_counter() - t0

    def run(self, batch: list[EncoderRequest], shape: tuple[int, int]) -> np.ndarray:
        """Each input's pooled rows, summed ([len(batch), hidden] f32; a cross-encoder's logit [len(batch), 1]),
        and marks them launched."""
        rows, tokens = shape
        ids = np.zeros((rows, tokens), np.int32)
        lengths = np.zeros((rows,), np.int32)
        weights = np.zeros((rows, tokens), np.float32)
        for i, request in enumerate(batch):
            n = len(request.token_ids)
            ids[i, :n], lengths[i] = request.token_ids, n
            positions = request.pooling.positions(0, n, n)
            weights[i, positions.start : positions.stop] = 1.0
            request.pooling.on_launched(positions)
        exe = self.compiled.get(shape)
        if exe is None:
            logger.warning("compiling a new encoder shape at serving time: %s", shape)
            exe = self.compiled[shape] = self._lower(*shape).compile()
            self.num_compilations += 1
        return np.asarray(jax.device_get(exe(self.params, ids, lengths, weights)))[: len(batch)]
