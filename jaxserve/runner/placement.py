"""Where a runner's weights live: its mesh (1 x pp x ep x tp), the parallelism plan a model needs, the
shardings a checkpoint is restored into, and the weights' dtype; and JAX's on-disk compilation cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from checkpoints import mxfp4
from checkpoints.config import ModelConfig
from checkpoints.params import param_shapes
from jaxserve.config import EngineConfig
from jaxserve.runner.pipeline_placement import plan_stages
from sharding.experts import plan_expert_parallel
from sharding.linear_heads import plan_linear_heads
from sharding.mesh import TensorParallelPlan, make_mesh, plan_tensor_parallel
from sharding.rules import param_shardings


def enable_persistent_compilation_cache(path: str) -> None:
    """JAX's on-disk compilation cache: a restart with the same buckets compiles nothing new."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def cast_params(params: Any, dtype: jnp.dtype) -> Any:
    """Matrices and embeddings in the compute dtype; norm scales stay f32, and the arrays of a
    quantized kernel (codes, scales, mins) as they are. Arrays already on devices (restored into
    shards) are cast there, never pulled back to the host."""

    def cast(path, x):
        name = jax.tree_util.keystr(path)
        if name.endswith(("['kernel_scale']", "['kernel_min']")) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        target = np.float32 if "scale" in name else dtype
        return x.astype(target) if isinstance(x, jax.Array) else np.asarray(x, target)

    return jax.tree_util.tree_map_with_path(cast, params)


def runner_mesh(engine_config: EngineConfig, mesh: Mesh | None = None) -> Mesh:
    """The 1 x pp x ep x tp mesh a runner's replica runs on (checked; by default the first pp x ep x tp devices)."""
    ep, tp = engine_config.expert_parallel_size, engine_config.tensor_parallel_size
    pp = engine_config.pipeline_parallel_size
    if mesh is None:
        if engine_config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 runs one engine per replica; build them with jaxserve.data_parallel.make_engine"
            )
        return make_mesh(tp, expert_parallel_size=ep, pipeline_parallel_size=pp)
    if (mesh.shape["dp"], mesh.shape["pp"], mesh.shape["ep"], mesh.shape["tp"]) != (1, pp, ep, tp):
        raise ValueError(
            f"a runner needs a 1 x pipeline_parallel_size ({pp}) x expert_parallel_size ({ep}) x "
            f"tensor_parallel_size ({tp}) mesh, got dp x pp x ep x tp = {mesh.shape['dp']} x {mesh.shape['pp']} x "
            f"{mesh.shape['ep']} x {mesh.shape['tp']}"
        )
    return mesh


def plan_parallelism(config: ModelConfig, engine_config: EngineConfig) -> TensorParallelPlan:
    """The tensor-parallel plan of `config`, after checking that the mesh's axes can split it
    (its pipeline stages too: `plan_stages`)."""
    plan_stages(config, engine_config)
    tp, ep = engine_config.tensor_parallel_size, engine_config.expert_parallel_size
    if config.num_experts:
        block = mxfp4.BLOCK if config.experts_mxfp4 else 1
        plan_expert_parallel(config.num_experts, config.moe_intermediate_size, ep, tp, block)
    elif ep > 1:
        raise ValueError(
            f"expert_parallel_size={ep} needs a mixture-of-experts model; {config.architecture} has no experts"
        )
    if config.linear_num_key_heads:
        plan_linear_heads(config, tp)
    return plan_tensor_parallel(config.num_heads, config.num_kv_heads, tp)


def checkpoint_shardings(engine_config: EngineConfig, mesh: Mesh | None = None) -> Callable[[ModelConfig], Any]:
    """Where a checkpoint's parameters are restored, for `load_model(shardings=...)`: the rules'
    shardings of the checkpoint's own shapes on the runner's mesh (kv heads are repeated later,
    on device, when tp needs more of them). A model tp cannot split is refused before any read."""

    def shardings(config: ModelConfig) -> Any:
        plan_parallelism(config, engine_config)
        return param_shardings(param_shapes(config), runner_mesh(engine_config, mesh), config)

    return shardings
