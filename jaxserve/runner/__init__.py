"""Model layer execution: `inputs` turns a scheduled iteration into bucketed host arrays,
`block_moves` runs the KV manager's block copies and swaps, `model_runner` owns the device state
(`device_state`) and runs the declared programs (`programs`, `step_functions`, compiled by
`executables`) of an iteration (`iteration`), whose outputs it reads (`step_handle`), on the mesh
`placement` sets up for the model `model_setup` builds."""

from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.placement import checkpoint_shardings, enable_persistent_compilation_cache
from jaxserve.runner.step_handle import StepHandle, read_hidden, read_pooled, read_prompt_scores

__all__ = [
    "ModelRunner",
    "StepHandle",
    "checkpoint_shardings",
    "enable_persistent_compilation_cache",
    "read_hidden",
    "read_pooled",
    "read_prompt_scores",
]
