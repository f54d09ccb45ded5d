"""The layers' matmuls on quantized kernels lower for CUDA on a machine with no GPU: the model's
own `Linear` on int8 and 4-bit arrays (`--quantization`), bf16 activations, a stacked kernel
indexed by layer, as the GPU engine runs it (no C++ kernel: the dequantize-then-dot in JAX); and
the tied output head stored quantized, with its lookup. The
lowered module reads the codes as integers (no f32 copy of the kernel is an input) and has the
one dot; XLA fuses the dequantization into it when it compiles for the GPU (bench.gpu_check,
stage quantized_matmul, runs it)."""

import jax
import jax.numpy as jnp
import pytest

from checkpoints.architectures import declare
from checkpoints.quant_format import QuantFormat
from checkpoints.tiny_random import tiny_random_config
from checkpoints.weights import abstract, flat, quantized
from jaxserve.model.linear import Linear
from jaxserve.model.quantized import QuantizedEmbed
from tests.kernels.test_kernel_gpu_lowering import HOPPER, gpu_target


@pytest.mark.parametrize(
    "fmt, codes", [(QuantFormat(8, 64), "tensor<2x64x128xi8>"), (QuantFormat(4, 32), "tensor<2x32x128xui8>")]
)
def test_quantized_linear_lowers_for_cuda(fmt, codes):
    config = tiny_random_config()  # gate_proj: [2 layers, 64, 128]
    declaration = quantized(declare(config), {"layers/gate_proj/kernel": fmt})
    linear = Linear(flat(declaration)["layers/gate_proj/kernel"], None, jnp.bfloat16, jnp.bfloat16)
    params = abstract(declaration, jnp.bfloat16)["layers"]["gate_proj"]
    x = jax.ShapeDtypeStruct((8, 64), jnp.bfloat16)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    with gpu_target(HOPPER):
        text = (
            jax.jit(lambda p, x, l: linear.apply({"params": p}, x, l))
            .trace(params, x, layer)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert codes in text and text.count("stablehlo.dot_general") == 1
    assert "tensor<8x128xbf16>" in text


def test_quantized_tied_head_and_lookup_lower_for_cuda():
    """The tied table stored as the head's int8 kernel [E, V]: the head is one dot on the codes read
    as integers, and the lookup gathers the tokens' columns (no dot, no float table as an input)."""
    config = tiny_random_config(tie_word_embeddings=True, vocab_size=320)
    fmt = QuantFormat(8, 32)
    declaration = quantized(declare(config), {"embed/kernel": fmt})
    embed = QuantizedEmbed(flat(declaration)["embed/kernel"], jnp.bfloat16, jnp.bfloat16)
    params = abstract(declaration, jnp.bfloat16)["embed"]
    x = jax.ShapeDtypeStruct((8, 64), jnp.bfloat16)
    tokens = jax.ShapeDtypeStruct((8,), jnp.int32)
    with gpu_target(HOPPER):
        head = (
            jax.jit(lambda p, x: embed.apply({"params": p}, x, method="attend"))
            .trace(params, x)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        lookup = (
            jax.jit(lambda p, t: embed.apply({"params": p}, t))
            .trace(params, tokens)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert "tensor<64x320xi8>" in head and head.count("stablehlo.dot_general") == 1
    assert "tensor<8x320xf32>" in head
    assert "tensor<64x320xi8>" in lookup and "dot_general" not in lookup and "tensor<8x64xbf16>" in lookup
