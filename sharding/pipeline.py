"""Pipeline stages: how a model's layers split over a mesh's `pp` axis.

Stage s holds a contiguous range of layers (their weights and their part of the KV cache). The
layers are stacked on a leading axis, and a stacked array split over `pp` gives each device the
same number of layers, so the stacks are laid out with `layers_per_stage` = ceil(L / P) positions per
stage. When P does not divide L the stages are uneven: the first L % P stages hold one layer more
than the others, and each shorter stage ends with one *identity* layer, a layer whose weights are
all zero (with zero weights a pre-norm residual block adds nothing: its attention reads V = 0,
its MLP's projections are 0). An identity layer costs the compute of a layer and its KV cache
slice; it never changes a result. `padded_index` maps each position to its model layer (-1: identity).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

PP = "pp"


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    num_layers: int  # the model's
    num_stages: int

    @property
    def layers_per_stage(self) -> int:
        return -(-self.num_layers // self.num_stages)

    @property
    def padded_layers(self) -> int:
        """Positions of the stacked layer axis: layers_per_stage x num_stages."""
        return self.layers_per_stage * self.num_stages

    def stage_layers(self, stage: int) -> range:
        """The model layers stage `stage` runs (contiguous)."""
        base, extra = divmod(self.num_layers, self.num_stages)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    @property
    def padded_index(self) -> np.ndarray:
        """[padded_layers] int32: the model layer at each position of the stacked layer axis (-1: identity)."""
        index = np.full(self.padded_layers, -1, np.int32)
        for s in range(self.num_stages):
            layers = self.stage_layers(s)
            index[s * self.layers_per_stage : s * self.layers_per_stage + len(layers)] = layers
        return index

    @property
    def is_uneven(self) -> bool:
        return self.padded_layers != self.num_layers

    def describe(self) -> str:
        """The stages' layer ranges, e.g. `pp=3: layers 0-9 | 10-19 | 20-29`."""
        ranges = " | ".join(f"{r.start}-{r.stop - 1}" for r in map(self.stage_layers, range(self.num_stages)))
        pad = f" ({self.padded_layers - self.num_layers} identity layers)" if self.is_uneven else ""
        return f"pp={self.num_stages}: layers {ranges}{pad}"


def plan_pipeline(num_layers: int, pipeline_parallel_size: int) -> PipelinePlan:
    """The stages of a model of `num_layers` layers over `pipeline_parallel_size` devices; raise
    ValueError saying why not. Uneven stages are allowed (see the module docstring)."""
    if not isinstance(pipeline_parallel_size, int) or pipeline_parallel_size < 1:
        raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {pipeline_parallel_size!r}")
    if pipeline_parallel_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pipeline_parallel_size} is larger than the model's {num_layers} layers: "
            f"every stage needs at least one layer; use at most {num_layers}"
        )
    return PipelinePlan(num_layers, pipeline_parallel_size)


def pad_layers(stacked: Any, plan: PipelinePlan) -> Any:
    """A stacked [L, ...] array (numpy or jax) laid out in the plan's layer positions [padded_layers, ...]:
    each stage's layers, then zeros in its identity layers. Unchanged when the stages are even."""
    if not plan.is_uneven:
        return stacked
    index = plan.padded_index
    xp = np if isinstance(stacked, np.ndarray) else jnp
    taken = stacked[xp.asarray(np.maximum(index, 0))]
    real = xp.asarray(index >= 0).reshape((-1,) + (1,) * (stacked.ndim - 1))
    return xp.where(real, taken, xp.zeros((), stacked.dtype))
