"""Which decode kernel the `pallas` backend runs: Triton (`decode.py`) or Mosaic GPU
(`decode_mosaic.py`), per GPU generation, as measured by `python3 -m bench.gpu_check`.

The GPU check times both kernels, JAX's shipped `paged_attention` and a device copy on one GPU
over batch x context, and its decode table ends with the pick for that GPU's generation
(`bench/gpu_check/decode_pick.py`): the faster kernel over the table's cases, provided it
matched the reference in every one. That pick is recorded in MEASURED below, keyed by CUDA
compute capability, since the kernels' performance follows the architecture, not the SKU (an
H100 and an H200 are both 9.0). A generation without an entry gets Triton, the kernel that
lowers for every CUDA generation; Mosaic GPU's kernel needs Hopper (TMA and WGMMA, 9.x).

The choice is made when a step function is traced (shapes and device are known then), so a
compiled program never switches. Where the Mosaic kernel cannot take the cache (f32, say, see
`decode_mosaic.unsupported_reason`), Triton runs.
"""

from __future__ import annotations

import jax

from kernels_pallas import decode, decode_mosaic

DECODE_KERNELS = ("triton", "mosaic")
# Compute capability -> decode kernel, from bench.gpu_check's pick on a GPU of that generation.
# Empty until a GPU run has measured one: see docs/gpu.md ("Picking the default").
MEASURED: dict[str, str] = {}


def compute_capability(device: jax.Device | None = None) -> str | None:
    """ "9.0" for a Hopper GPU; None for a device that is not a CUDA GPU."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return None
    cc = getattr(device, "compute_capability", None)
    return str(cc) if cc else None


def mosaic_runs_on(capability: str | None) -> bool:
    """Whether the Mosaic GPU kernel can run on a GPU of this compute capability (Hopper)."""
    return capability is not None and capability.split(".")[0] == "9"


def decode_kernel_for(capability: str | None, measured: dict[str, str] | None = None) -> str:
    """The decode kernel for a GPU generation: the measured pick, else Triton."""
    table = MEASURED if measured is None else measured
    pick = table.get(capability or "", "triton")
    if pick not in DECODE_KERNELS:
        raise ValueError(f"MEASURED[{capability!r}] = {pick!r}; choose from: {', '.join(DECODE_KERNELS)}")
    return pick if pick == "triton" or mosaic_runs_on(capability) else "triton"


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """The `pallas` backend's decode: this GPU generation's kernel (see the module docstring)."""
    kernel = decode.decode_attention
    if decode_kernel_for(compute_capability()) == "mosaic":
        num_heads, head_dim = q.shape[1:]
        num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[3]
        if decode_mosaic.unsupported_reason(num_heads, num_kv_heads, head_dim, block_size, k_cache.dtype) is None:
            kernel = decode_mosaic.decode_attention
    options = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, sinks=sinks)
    return kernel(q, k_cache, v_cache, layer, block_tables, lengths, **options)
