"""KV cache formats (`kernels_pallas.kv_quant`): the round trip's error bounds, and every backend
(cpu C++ kernels, paged_jax, the Pallas Triton kernels interpreted) equal to the reference on the
same stored cache, for bf16 bits, int8 and fp8 rows with their scales."""

import jax
import jax.numpy as jnp
import numpy as np
import paged_cases as pc
import pytest
from jax import lax

from kernels_pallas import cpu_attention, cpu_build, decode, kv_quant, prefill

FORMATS = ("bfloat16", "int8", "fp8")
# The reference computes a bf16 cache's softmax weights in bf16 (as the GPU kernels do); the
# others keep them f32, and read int8 / fp8 values times scale exactly as the reference does.
TOLERANCE = {"bfloat16": pc.TOLERANCE[jnp.bfloat16], "int8": 1e-5, "fp8": 1e-5}
KV_HEADS, HEADS, BLOCK, BLOCKS, WIDTH = 2, 6, 8, 24, 6


def stored(name: str, x: jax.Array) -> jax.Array:
    return kv_quant.quantize(x, kv_quant.storage_dtype(name, jnp.float32, "cpu"))


def test_storage_dtypes_and_rows():
    sd = kv_quant.storage_dtype
    assert sd("auto", jnp.float32, "cpu") == jnp.float32 and sd("auto", jnp.bfloat16, "gpu") == jnp.bfloat16
    assert sd("bfloat16", jnp.float32, "cpu") == jnp.uint16 and sd("bfloat16", jnp.float32, "gpu") == jnp.bfloat16
    assert sd("fp8", jnp.float32, "cpu") == sd("fp8_e4m3", jnp.bfloat16, "gpu") == jnp.uint8
    assert sd("int8", jnp.float32, "gpu") == jnp.int8
    with pytest.raises(ValueError, match="auto, float32, bfloat16, fp8, fp8_e4m3, int8"):
        sd("fp4", jnp.float32, "cpu")
    assert [kv_quant.format_name(sd(n, jnp.float32, "cpu")) for n in ("auto", "bfloat16", "fp8", "int8")] == [
        "float32",
        "bfloat16",
        "fp8",
        "int8",
    ]
    assert [kv_quant.row_width(64, sd(n, jnp.float32, "cpu")) for n in ("auto", "bfloat16", "int8")] == [64, 64, 68]


def test_round_trip_error_bounds():
    """int8: within half a step (max|row| / 254); fp8 e4m3: 3 mantissa bits, within 2^-4 of each
    value (or half the smallest subnormal step near zero); bf16: within 2^-8 of each value. Scales
    are per (token, head): a row of zeros stays zeros, and a small row keeps its precision next to
    a large one."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 4, 5, 64)) * rng.uniform(0.01, 100, (3, 4, 5, 1)), jnp.float32)
    x = x.at[0, 0, 0].set(0.0)
    back = {
        name: np.asarray(jax.jit(lambda a, n=name: kv_quant.dequantize(stored(n, a)).astype(jnp.float32))(x))
        for name in FORMATS
    }
    x = np.asarray(x)
    amax = np.maximum(np.max(np.abs(x), axis=-1, keepdims=True), 1e-30)
    err = {name: np.abs(back[name] - x) for name in FORMATS}
    assert np.all(err["int8"] <= amax / 254 * 1.0001)
    assert np.all(err["fp8"] <= np.maximum(np.abs(x) * 2.0**-4, amax / 448 * 2.0**-10) * 1.0001)
    assert np.all(err["bfloat16"] <= np.abs(x) * 2.0**-8)
    for name in FORMATS:
        assert not back[name][0, 0, 0].any()
    assert np.max(err["int8"] / amax) > 1e-4  # int8 really rounds


def test_fp8_bits_are_xlas_conversions():
    """`kv_quant` codes fp8 with integer ops (XLA:CPU's float8 conversion is slow, Triton's needs an
    fp8 GPU): every finite code decodes to XLA's value, and values within +-448, the codes' values
    and the midpoints between them (rounding to nearest even) encode to XLA's codes."""
    codes = jnp.asarray([c for c in range(256) if c & 0x7F != 0x7F], jnp.uint8)
    values = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(kv_quant.fp8_bits_to_f32(codes)), np.asarray(values))
    exact = np.sort(np.asarray(values))
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [exact, (exact[1:] + exact[:-1]) / 2, rng.uniform(-448, 448, 5000), rng.uniform(-0.03, 0.03, 5000)]
    ).astype(np.float32)
    want = lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float8_e4m3fn), jnp.uint8)
    np.testing.assert_array_equal(np.asarray(jax.jit(kv_quant.f32_to_fp8_bits)(x)), np.asarray(want))


def _inputs(seed: int, name: str):
    rng = np.random.default_rng(seed)
    cache = pc.make_cache(rng, KV_HEADS, BLOCK, BLOCKS, jnp.float32)
    return rng, stored(name, cache.k), stored(name, cache.v)


def _check_decode(fn, name: str, **options) -> None:
    rng, k, v = _inputs(1, name)
    lengths = pc.decode_lengths(rng, BLOCK, WIDTH)
    tables = pc.block_tables(rng, lengths, WIDTH, BLOCKS)
    q = pc.queries(rng, len(lengths), HEADS, jnp.float32)
    args = (q, k, v, jnp.int32(pc.LAYER), tables, jnp.asarray(lengths, jnp.int32))
    pc.assert_close(fn(*args, scale=pc.SCALE, **options), pc.reference_decode(*args, scale=pc.SCALE), TOLERANCE[name])


def _check_prefill(fn, name: str, **options) -> None:
    rng, k, v = _inputs(2, name)
    seqs = pc.prefill_sequences(rng, BLOCK, WIDTH)
    seq_lens = jnp.asarray([h + n for h, n in seqs], jnp.int32)
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum([n for _, n in seqs])]), jnp.int32)
    tables = pc.block_tables(rng, [int(n) for n in seq_lens], WIDTH, BLOCKS)
    q = pc.queries(rng, int(query_start[-1]) + 3, HEADS, jnp.float32)
    args = (q, k, v, jnp.int32(pc.LAYER), tables, seq_lens, query_start)
    want = pc.reference_prefill(*args, scale=pc.SCALE)
    pc.assert_close(fn(*args, scale=pc.SCALE, **options), want, TOLERANCE[name])


needs_cxx = pytest.mark.skipif(not cpu_build.available(), reason="no C++ compiler")


def slow_but(*fast: str) -> list:
    """FORMATS, those not in `fast` under the slow mark: a backend that reads every format through
    the same `kv_quant` code compiles for minutes in all; CI covers one scaled format each."""
    return [name if name in fast else pytest.param(name, marks=pytest.mark.slow) for name in FORMATS]


@needs_cxx
@pytest.mark.parametrize("name", FORMATS)
def test_cpu_kernels_equal_the_reference(name):
    _check_decode(pc.PLAIN_JAX["cpu"][0], name)
    _check_prefill(pc.PLAIN_JAX["cpu"][1], name)


@pytest.mark.parametrize("name", slow_but("int8"))
def test_paged_jax_equals_the_reference(name):
    _check_decode(pc.PLAIN_JAX["jax"][0], name)
    _check_prefill(pc.PLAIN_JAX["jax"][1], name)


@pytest.mark.parametrize("name", slow_but("fp8"))
def test_triton_kernels_equal_the_reference(name):
    """Interpreted on CPU; a scaled row's values and scale bytes are loaded apart (GPU lowering:
    test_kernel_gpu_lowering.py). Two flash-decoding splits."""
    _check_decode(decode.decode_attention, name, num_splits=2, interpret=pc.interpret())
    _check_prefill(prefill.prefill_attention, name, interpret=pc.interpret())


@needs_cxx
@pytest.mark.slow
@pytest.mark.parametrize("name", FORMATS)
def test_cpu_kernels_at_other_head_dims_with_a_window(name):
    """The C++ kernels are specialized on head_dim and the query-head group: 80 and 128 dims,
    a group larger than one register group, soft cap and sliding window (CI: the same code at
    one shape, `test_cpu_kernels_equal_the_reference`)."""
    rng = np.random.default_rng(3)
    for dim, group in ((80, 2), (128, 5)):
        shape = (2, 1, 20, 16, dim)
        k, v = (stored(name, jnp.asarray(rng.standard_normal(shape), jnp.float32)) for _ in range(2))
        tables = jnp.asarray(np.stack([rng.permutation(np.arange(1, 20))[:8] for _ in range(3)]), jnp.int32)
        lengths = jnp.asarray([1, 77, 128], jnp.int32)
        q = jnp.asarray(rng.standard_normal((3, group, dim)), jnp.float32)
        options = dict(scale=dim**-0.5, soft_cap=3.0, sliding_window=40)
        want = pc.reference_decode(q, k, v, jnp.int32(1), tables, lengths, **options)
        got = jax.jit(cpu_attention.decode_attention, static_argnames=tuple(options))(
            q, k, v, jnp.int32(1), tables, lengths, **options
        )
        pc.assert_close(got, want, TOLERANCE[name])
        query_start = jnp.asarray([0, 1, 30, 60], jnp.int32)
        want = pc.reference_prefill(q.repeat(20, axis=0), k, v, jnp.int32(1), tables, lengths, query_start, **options)
        got = jax.jit(cpu_attention.prefill_attention, static_argnames=tuple(options))(
            q.repeat(20, axis=0), k, v, jnp.int32(1), tables, lengths, query_start, **options
        )
        pc.assert_close(got, want, TOLERANCE[name])


@needs_cxx
def test_cpu_kernel_reads_a_native_bf16_cache_as_its_bits():
    rng, k, v = _inputs(4, "bfloat16")
    lengths = jnp.asarray([5, 40], jnp.int32)
    tables = pc.block_tables(rng, [5, 40], WIDTH, BLOCKS)
    q = pc.queries(rng, 2, HEADS, jnp.float32)
    bits = cpu_attention.decode_attention(q, k, v, jnp.int32(0), tables, lengths, scale=0.2)
    native = cpu_attention.decode_attention(
        q, kv_quant.dequantize(k), kv_quant.dequantize(v), jnp.int32(0), tables, lengths, scale=0.2
    )
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(native))
