"""bfloat16 weights: on CPU, activations and the KV cache stay f32; the stacked layer kernels are
stored in the cpu matmul's bf16 panels where it takes them, packed elsewhere; the packed model
computes what the unpacked one does, the cpu matmul's what XLA's bf16 dots do, and a bf16 engine
serves greedy text close to the f32 one."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.registry import load_model
from checkpoints.weights import EMBED, KERNEL, Q_HEADS, Weight
from jaxserve.config import EngineConfig
from jaxserve.config_resolution import resolve
from jaxserve.llm import LLM
from jaxserve.model import AttentionMetadata, DecoderModel, KVCache
from jaxserve.model.layout import compute_dtype, pack_kernels, packs_kernels, panel_kernels
from jaxserve.model.linear import Linear
from jaxserve.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from kernels_pallas import cpu_build, cpu_matmul, get_attention_backend, kv_quant

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
    weight = Weight((8, 6), (EMBED, Q_HEADS), KERNEL)  # one layer's
    for layer in range(3):
        plain = Linear(weight, None, jnp.float32, jnp.bfloat16).apply({"params": {"kernel": kernel[layer]}}, x)
        got = Linear(weight, None, jnp.float32, jnp.bfloat16, packed=True).apply(
            {"params": {"kernel": packed[layer]}}, x
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    with pytest.raises(ValueError, match="odd"):
        pack_kernels({"layers": {"up_proj": {"kernel": jnp.zeros((2, 4, 5), jnp.bfloat16)}}})


@on_cpu
def test_bfloat16_runner_on_cpu_keeps_a_bf16_cache_and_packs_kernels():
    """XLA's dots (the `jax` backend: no cpu matmul): every stacked kernel packed; activations
    f32, the KV cache the weights' bf16 (as its bits) unless --kv-cache-dtype says otherwise."""
    model = load_model("tiny-random")
    config = EngineConfig(num_blocks=16, dtype="bfloat16", attention_backend="jax")
    runner = ModelRunner(model.config, model.params, resolve(config, model.config))
    assert runner.model.cpu_matmul is None
    assert runner.cache_dtype == jnp.float32
    assert runner.cache.k.dtype == jnp.uint16 and kv_quant.format_name(runner.kv_dtype) == "bfloat16"
    f32_cache = ModelRunner(
        model.config,
        model.params,
        resolve(dataclasses.replace(config, kv_cache_dtype="float32"), model.config),
    )
    assert f32_cache.cache.k.dtype == jnp.float32
    layers = runner.params["layers"]
    assert layers["q_proj"]["kernel"].dtype == jnp.uint32
    assert layers["attn_norm"]["scale"].dtype == jnp.float32
    assert runner.params["embed"]["embedding"].dtype == jnp.bfloat16


@on_cpu
@pytest.mark.skipif(not cpu_build.available(), reason="no C++ compiler")
def test_bfloat16_runner_on_cpu_stores_panels_for_the_cpu_matmul():
    """The `cpu` backend: the kernels the cpu matmul takes in its bf16 panels (half f32's bytes),
    the others packed; the cache bf16 (as its bits)."""
    model = load_model("tiny-random")
    runners = {
        dtype: ModelRunner(model.config, model.params, resolve(EngineConfig(num_blocks=16, dtype=dtype), model.config))
        for dtype in ("float32", "bfloat16")
    }
    runner, matmul = runners["bfloat16"], runners["bfloat16"].model.cpu_matmul
    assert matmul is not None and runner.cache.k.dtype == jnp.uint16
    for name, proj in runner.params["layers"].items():
        if "kernel" not in proj:
            continue
        fan_in, features = model.params["layers"][name]["kernel"].shape[1:]
        if matmul.takes(features):
            assert proj["kernel"].dtype == jnp.bfloat16
            assert proj["kernel"].shape == matmul.stored_shape(model.config.num_layers, fan_in, features, jnp.bfloat16)
        else:
            assert proj["kernel"].dtype == jnp.uint32, name
    assert matmul.takes(model.config.num_heads * model.config.head_dim)  # q_proj: the kernel runs
    f32, bf16 = runners["float32"].weight_bytes, runner.weight_bytes
    assert f32 == sum(np.asarray(x).nbytes for x in jax.tree.leaves(model.params))  # all f32 there
    assert bf16 < 0.51 * f32  # bf16 but for the norms


@on_cpu
@pytest.mark.skipif(not cpu_build.available(), reason="no C++ compiler")
def test_bfloat16_cpu_matmul_gives_the_logits_of_xlas_bf16_dots():
    """The model on the cpu matmul's bf16 panels and bf16 head kernel computes what the model on
    XLA's bf16 dots does (bf16 operands, f32 sums), for a prefill of many rows and a decode row:
    within f32 rounding, far below the bf16 rounding that separates both from f32 weights."""
    loaded = load_model("tiny-random")
    cfg = dataclasses.replace(loaded.config, tie_word_embeddings=True)  # the head kernel too
    bs, n = 4, 18
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: jnp.asarray(a, jnp.float32 if "scale" in jax.tree_util.keystr(p) else jnp.bfloat16),
        {k: v for k, v in loaded.params.items() if k != "lm_head"},
    )
    matmul = cpu_matmul.kernels()
    tokens = jnp.arange(1, n + 1, dtype=jnp.int32)
    table = jnp.arange(1, 7, dtype=jnp.int32)[None]
    logits = {}
    for name, lm, tree in (
        ("xla", None, pack_kernels(params)),
        ("kernel", matmul, pack_kernels(panel_kernels(params, matmul))),
    ):
        model = DecoderModel(cfg, get_attention_backend("cpu"), jnp.bfloat16, cpu_matmul=lm)
        step = jax.jit(model.apply)
        cache = KVCache.zeros(cfg, 8, bs, jnp.float32)
        meta = AttentionMetadata(
            jnp.arange(bs, bs + n, dtype=jnp.int32), table, jnp.array([n], jnp.int32), jnp.array([0, n], jnp.int32)
        )
        args = ({"params": tree}, tokens, jnp.arange(n), cache, meta, jnp.arange(n))
        if lm is not None:
            hlo = step.lower(*args).as_text()
            assert cpu_matmul.LAYER_BF16 in hlo and cpu_matmul.HEAD_BF16 in hlo
        prefill, cache = step(*args)
        meta = AttentionMetadata(jnp.array([bs + n], jnp.int32), table, jnp.array([n + 1], jnp.int32))
        decode, _ = step({"params": tree}, jnp.array([7], jnp.int32), jnp.array([n]), cache, meta, jnp.array([0]))
        logits[name] = np.concatenate([np.asarray(prefill), np.asarray(decode)])
    scale = np.abs(logits["xla"]).max()
    np.testing.assert_allclose(logits["kernel"], logits["xla"], rtol=0, atol=1e-4 * scale)


@on_cpu
def test_bfloat16_logits_close_to_float32():
    """The same weights rounded to bf16: one prefill's logits within bf16 rounding of f32's."""
    loaded = load_model("tiny-random")
    cfg, bs, n = loaded.config, 4, 6
    cache = KVCache.zeros(cfg, 4, bs, jnp.float32)
    tokens = jnp.arange(1, n + 1, dtype=jnp.int32)
    meta = AttentionMetadata(
        jnp.arange(bs, bs + n, dtype=jnp.int32),
        jnp.array([[1, 2, 0]], jnp.int32),
        jnp.array([n], jnp.int32),
        jnp.array([0, n], jnp.int32),
    )
    logits = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        model = DecoderModel(cfg, get_attention_backend("reference"), dtype)
        params = jax.tree_util.tree_map_with_path(
            lambda p, a: jnp.asarray(a, jnp.float32 if "scale" in jax.tree_util.keystr(p) else dtype), loaded.params
        )
        if model.packed:
            params = pack_kernels(params)
        logits[dtype], _ = model.apply({"params": params}, tokens, jnp.arange(n), cache, meta, jnp.arange(n))
    f32, bf16 = np.asarray(logits[jnp.float32]), np.asarray(logits[jnp.bfloat16])
    assert bf16.dtype == np.float32
    scale = np.abs(f32).max()
    assert np.abs(bf16 - f32).max() <= 0.05 * scale
    assert not np.array_equal(bf16, f32)  # the weights really were rounded


@on_cpu
@pytest.mark.slow  # ~50 s; the golden-prompts test below serves the default model in bf16 and f32 too
def test_bfloat16_engine_greedy_text_matches_float32_on_the_default_model(assert_kv_all_free):
    """SmolLM2 in bf16 keeps f32's greedy continuation of short prompts (the first tokens)."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    texts = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(
            dtype=dtype,
            max_num_seqs=4,
            max_model_len=256,
            decode_batch_buckets=(4,),
            max_num_batched_tokens=32,
            prefill_token_buckets=(32,),
            prefill_seq_buckets=(2,),
        )
        texts[dtype] = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_kv_all_free(llm.engine)
    assert texts["bfloat16"] == texts["float32"]


GOLDEN = json.loads((Path(__file__).parent / "data" / "smollm2_reference.json").read_text())["greedy"]
FLIP_TOLERANCE = 0.05  # logit units: how close f32's scores of two tokens are where bf16 may pick the other
LOGPROB_TOLERANCE = 0.15  # |bf16 - f32| log-probability of the same token at the same position


@on_cpu
@pytest.mark.integration
def test_bfloat16_greedy_tokens_on_the_golden_prompts(assert_kv_all_free, capsys):
    """The default model served in bf16 and in f32, same run, on the golden prompts (32 greedy
    tokens each): the same tokens, or the same up to a position where f32's two best tokens are
    within FLIP_TOLERANCE (a bf16 rounding may flip that argmax); there bf16's token must be one
    of f32's top five and within FLIP_TOLERANCE of its best (the first divergence is printed).
    Before it, each token's log-probability within LOGPROB_TOLERANCE of f32's. No compilation
    after warm-up; the bf16 engine's weights about half f32's bytes."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
    engine = dict(
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=256,
        decode_batch_buckets=(8,),
        sampler_row_buckets=(8,),
        prefill_token_buckets=(128,),
        prefill_seq_buckets=(4,),
        block_table_buckets=(16,),
        num_blocks=128,
    )
    outs, weight_bytes = {}, {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, **engine)
        compiled = llm.engine.num_compilations
        outs[dtype] = [
            o.outputs[0]
            for o in llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in GOLDEN], params, use_tqdm=False)
        ]
        assert llm.engine.num_compilations == compiled, dtype
        weight_bytes[dtype] = llm.engine.runner.weight_bytes
        assert_kv_all_free(llm.engine)
        del llm
    same = 0
    for case, f32, bf16 in zip(GOLDEN, outs["float32"], outs["bfloat16"]):
        assert f32.token_ids == case["new_ids"], case["name"]  # f32 is transformers' f32
        flip = next((i for i, (a, b) in enumerate(zip(f32.token_ids, bf16.token_ids)) if a != b), None)
        for i in range(len(f32.token_ids) if flip is None else flip):
            assert abs(bf16.logprobs[i].logprob - f32.logprobs[i].logprob) <= LOGPROB_TOLERANCE, (case["name"], i)
        if flip is None:
            same += 1
            continue
        top = dict(f32.logprobs[flip].top)
        picked = bf16.token_ids[flip]
        with capsys.disabled():
            print(
                f"\n{case['name']}: first divergence at token {flip}: f32 {f32.token_ids[flip]} "
                f"({top[f32.token_ids[flip]]:.4f}), bf16 {picked} (f32 scores it {top.get(picked, float('nan')):.4f})"
            )
        assert picked in top, case["name"]
        assert top[f32.token_ids[flip]] - top[picked] <= FLIP_TOLERANCE, case["name"]
    assert same >= len(GOLDEN) - 2  # flips are the exception
    assert weight_bytes["bfloat16"] < 0.51 * weight_bytes["float32"]


TP_SCRIPT = """
import json
from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams
tokens = {}
for tp in (1, 2):
    # the jax backend: at tp=1 too the packed kernels and XLA's dots (the cpu backend's bf16 panels
    # run only on one device; they are tested against XLA's dots above)
    # warm_up=False: only tokens and shardings are checked here, so only the shapes served are compiled
    llm = LLM(model="tiny-random", dtype="bfloat16", tensor_parallel_size=tp, attention_backend="jax", warm_up=False,
              max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, prefill_token_buckets=(32,),
              prefill_seq_buckets=(2,), decode_batch_buckets=(4,))
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


@on_cpu
def test_auto_dtype_is_bf16_where_the_cpu_kernels_have_avx512_bf16(caplog):
    """`dtype="auto"` (the command line's default): bf16 on a CPU whose bf16 kernels use
    AVX512-BF16 and run (cpu backend, one device, scanned layers), f32 otherwise; logged."""
    from jaxserve.dtype_choice import choose_dtype, weights_dtype

    fast = cpu_build.available() and cpu_matmul.bf16_dot()
    with caplog.at_level("INFO", logger="jaxserve.dtype_choice"):
        dtype = weights_dtype(EngineConfig(num_blocks=16, dtype="auto"))
    assert dtype == ("bfloat16" if fast else "float32")
    assert f"dtype auto: {dtype}" in caplog.text
    for other in (
        dict(attention_backend="jax"),
        dict(tensor_parallel_size=2),
        dict(pipeline_parallel_size=2),
        dict(unroll_layers=True),
    ):
        assert choose_dtype(EngineConfig(num_blocks=16, dtype="auto", **other))[0] == "float32"
    assert weights_dtype(EngineConfig(num_blocks=16, dtype="float32")) == "float32"  # given: kept
    llm = LLM(
        model="tiny-random",
        warm_up=False,  # the dtype is chosen when the engine is built: nothing here needs its programs
        dtype="auto",
        num_blocks=16,
        max_num_seqs=2,
        max_model_len=64,
        max_num_batched_tokens=16,
        prefill_token_buckets=(16,),
        prefill_seq_buckets=(1,),
        decode_batch_buckets=(2,),
    )
    assert llm.engine.config.dtype == dtype and llm.engine.runner.dtype == jnp.dtype(dtype)
