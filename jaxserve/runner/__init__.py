"""Model layer execution: `inputs` turns a scheduled iteration into bucketed host arrays,
`block_moves` runs the KV manager's block copies and swaps, `model_runner` compiles the steps and
launches and reads iterations on the devices (`step_handle`), on the mesh `placement` sets up."""

from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.placement import checkpoint_shardings, enable_persistent_compilation_cache
from jaxserve.runner.step_handle import StepHandle, read_pooled, read_prompt_scores

__all__ = [
    "ModelRunner",
    "StepHandle",
    "checkpoint_shardings",
    "enable_persistent_compilation_cache",
    "read_pooled",
    "read_prompt_scores",
]
