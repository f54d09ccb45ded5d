"""Model layer execution: `inputs` turns a scheduled iteration into bucketed host arrays,
`block_moves` runs the KV manager's block copies and swaps, `model_runner` compiles the steps and
launches and reads iterations on the devices."""

from jaxserve.runner.model_runner import (
    ModelRunner,
    StepHandle,
    checkpoint_shardings,
    enable_persistent_compilation_cache,
)

__all__ = ["ModelRunner", "StepHandle", "checkpoint_shardings", "enable_persistent_compilation_cache"]
