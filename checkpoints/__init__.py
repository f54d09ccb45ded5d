"""Checkpoint loading (GGUF, Hugging Face safetensors, Orbax) and the model registry.

Entry points (imported from their modules, so that `checkpoints.config` stays light):
- `checkpoints.registry.load_model(spec, dtype, shardings) -> LoadedModel` and `convert(src, dst)`;
- `checkpoints.gguf.load_gguf`, `checkpoints.hf.load_hf_dir` / `save_hf_dir`,
  `checkpoints.orbax_io.load_orbax` / `save_orbax`;
- `checkpoints.params` documents the parameter tree every loader returns.
"""
