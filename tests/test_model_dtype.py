"""bfloat16 weights: on CPU, activations and the KV cache stay f32 and the stacked layer kernels
are stored packed; the packed model computes what the unpacked one does, and a bf16 engine
serves greedy text close to the f32 one."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.registry import load_model
from jaxserve.config import EngineConfig
from jaxserve.llm import LLM
from jaxserve.model import AttentionMetadata, KVCache, LlamaModel
from jaxserve.model.llama import Linear, compute_dtype, pack_kernels, packs_kernels
from jaxserve.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from kernels_pallas import get_attention_backend

on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the f32 activations and packing are for CPU")


def test_compute_dtype_and_packing_by_platform():
    assert compute_dtype(jnp.bfloat16, "cpu") == jnp.float32
    assert compute_dtype(jnp.float32, "cpu") == jnp.float32
    assert compute_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
    assert compute_dtype("bfloat16", "tpu") == jnp.bfloat16
    assert packs_kernels(jnp.bfloat16, "cpu") and not packs_kernels(jnp.float32, "cpu")
    assert not packs_kernels(jnp.bfloat16, "gpu")


def test_packed_linear_equals_plain():
    rng = np.random.default_rng(0)
    kernel = jnp.asarray(rng.standard_normal((3, 8, 6)), jnp.bfloat16)  # stacked [L, in, out]
    x = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)
    packed = pack_kernels({"layers": {"q_proj": {"kernel": kernel}}})["layers"]["q_proj"]["kernel"]
    assert packed.dtype == jnp.uint32 and packed.shape == (3, 8, 3)
    for layer in range(3):
        plain = Linear(6, False, jnp.float32, jnp.bfloat16).apply({"params": {"kernel": kernel[layer]}}, x)
        got = Linear(6, False, jnp.float32, jnp.bfloat16, packed=True).apply({"params": {"kernel": packed[layer]}}, x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    with pytest.raises(ValueError, match="odd"):
        pack_kernels({"layers": {"up_proj": {"kernel": jnp.zeros((2, 4, 5), jnp.bfloat16)}}})


@on_cpu
def test_bfloat16_runner_on_cpu_keeps_an_f32_cache_and_packs_kernels():
    model = load_model("tiny-random")
    runner = ModelRunner(model.config, model.params, EngineConfig(num_blocks=16, dtype="bfloat16"))
    assert runner.cache.k.dtype == runner.cache_dtype == jnp.float32
    layers = runner.params["layers"]
    assert layers["q_proj"]["kernel"].dtype == jnp.uint32
    assert layers["attn_norm"]["scale"].dtype == jnp.float32
    assert runner.params["embed"]["embedding"].dtype == jnp.bfloat16


@on_cpu
def test_bfloat16_logits_close_to_float32():
    """The same weights rounded to bf16: one prefill's logits within bf16 rounding of f32's."""
    loaded = load_model("tiny-random")
    cfg, bs, n = loaded.config, 4, 6
    cache = KVCache.zeros(cfg, 4, bs, jnp.float32)
    tokens = jnp.arange(1, n + 1, dtype=jnp.int32)
    meta = AttentionMetadata(jnp.arange(bs, bs + n, dtype=jnp.int32), jnp.array([[1, 2, 0]], jnp.int32),
                             jnp.array([n], jnp.int32), jnp.array([0, n], jnp.int32))
    logits = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        model = LlamaModel(cfg, get_attention_backend("reference"), dtype)
        params = jax.tree_util.tree_map_with_path(
            lambda p, a: jnp.asarray(a, jnp.float32 if "scale" in jax.tree_util.keystr(p) else dtype), loaded.params)
        if model.packed:
            params = pack_kernels(params)
        logits[dtype], _ = model.apply({"params": params}, tokens, jnp.arange(n), cache, meta, jnp.arange(n))
    f32, bf16 = np.asarray(logits[jnp.float32]), np.asarray(logits[jnp.bfloat16])
    assert bf16.dtype == np.float32
    scale = np.abs(f32).max()
    assert np.abs(bf16 - f32).max() <= 0.05 * scale
    assert not np.array_equal(bf16, f32)  # the weights really were rounded


@on_cpu
def test_bfloat16_engine_greedy_text_matches_float32_on_the_default_model(assert_kv_all_free):
    """SmolLM2 in bf16 keeps f32's greedy continuation of short prompts (the first tokens)."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    texts = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, max_num_seqs=4, max_model_len=256, decode_batch_buckets=(4,),
                  max_num_batched_tokens=32, prefill_token_buckets=(32,), prefill_seq_buckets=(2,))
        texts[dtype] = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_kv_all_free(llm.engine)
    assert texts["bfloat16"] == texts["float32"]


TP_SCRIPT = """
import json
from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams
tokens = {}
for tp in (1, 2):
    llm = LLM(model="tiny-random", dtype="bfloat16", tensor_parallel_size=tp, max_num_seqs=4, max_model_len=128,
              max_num_batched_tokens=32, prefill_token_buckets=(32,), prefill_seq_buckets=(2,), decode_batch_buckets=(4,))
    kernel = llm.engine.runner.params["layers"]["q_proj"]["kernel"]
    assert kernel.dtype.name == "uint32" and len(kernel.sharding.device_set) == tp
    outs = llm.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    tokens[tp] = [o.outputs[0].token_ids for o in outs]
print(json.dumps(tokens))
"""


@on_cpu
def test_bfloat16_packed_kernels_split_over_tensor_parallel_devices():
    """Packed kernels split over tp like plain ones (whole heads a device): tp=2 equals tp=1."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-c", TP_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert tokens["1"] == tokens["2"]
    assert [len(t) for t in tokens["1"]] == [12, 12]
