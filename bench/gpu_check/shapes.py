"""The model shapes the GPU check runs (random weights): the real models' on the GPU, tiny ones of the
same families in the CPU dry run. No JAX here (the supervisor reads the plan without a device)."""

from __future__ import annotations

import dataclasses

from checkpoints.config import ModelConfig

# The default model's shape (SmolLM2-135M) and Llama-3-8B's, with random weights in bf16.
SMOLLM2_135M = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
)
# The families' blocks (stage `models` and its engine stages): a Qwen3-MoE shape of 16 layers (128
# experts of 768 hidden units, top-8: the grouped matmuls) and Gemma 3 1B's (local 512-token
# windows interleaved five to one with global layers), random weights in bf16.
MOE_MODEL, WINDOW_MODEL = "qwen3-moe-16l", "gemma3-1b"
# Stage `speculative`: DeepSeek-V3's attention (MLA, 128 heads) and experts' shapes on 2 layers (one dense,
# one of 32 experts, top-8) and its MTP layer, random weights in bf16: ~7.6B parameters per engine.
SPEC_MODEL = "deepseek-v3-2l"
QWEN3_MOE_16L = ModelConfig(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=16,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    architecture="qwen3_moe",
    qk_norm=True,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    max_position_embeddings=40960,
)
DEEPSEEK_V3_2L = ModelConfig(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    num_layers=2,
    num_heads=128,
    num_kv_heads=128,
    head_dim=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    architecture="deepseek_v3",
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_interleave=True,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    scoring_func="sigmoid",
    num_experts=32,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    first_k_dense_replace=1,
    num_nextn_predict_layers=1,
    max_position_embeddings=163840,
)
GEMMA3_1B = ModelConfig(
    vocab_size=262144,
    hidden_size=1152,
    intermediate_size=6912,
    num_layers=26,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    architecture="gemma3",
    qk_norm=True,
    post_norms=True,
    hidden_act="gelu_tanh",
    scale_embeddings=True,
    query_pre_attn_scalar=256.0,
    sliding_window=512,
    rope_local_theta=10_000.0,
    max_position_embeddings=32768,
    layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)),
)
# Gemma 3 270M's shape: the text model `bench.vision_ttft --real-shape` pairs with Gemma 3 4B's vision
# tower (4B's own text model, 4.3B parameters, is too large for a CPU machine's f32 figures).
GEMMA3_270M = dataclasses.replace(
    GEMMA3_1B,
    hidden_size=640,
    intermediate_size=2048,
    num_layers=18,
    num_heads=4,
    layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)),
)
# Gemma 3 4B's vision tower (`gemma3_vision.VisionConfig` fields but its token ids): SigLIP with 27 layers
# of 1152 features (16 heads, MLP 4304) over 896-pixel images in 14-pixel patches (4096 patches), pooled
# to 256 soft tokens and projected to the 4B text model's 2560 features. Stage `vision_encoder` and
# `bench.vision_ttft --real-shape`.
GEMMA3_4B_TOWER = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_layers=27,
    num_heads=16,
    image_size=896,
    patch_size=14,
    layer_norm_eps=1e-6,
    mm_tokens_per_image=256,
    text_hidden_size=2560,
)
# Dry-run stand-ins: the same attention grouping (3 and 4 query heads per kv head), tiny sizes.
TINY_SMOLLM2 = dataclasses.replace(
    SMOLLM2_135M,
    vocab_size=512,
    hidden_size=96,
    intermediate_size=192,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
)
TINY_LLAMA3 = dataclasses.replace(
    LLAMA3_8B,
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
)
# ... and of the families' models: 8 experts of 64 units (top-2), windows of 8 tokens (prompts of 24).
TINY_QWEN3_MOE = dataclasses.replace(
    QWEN3_MOE_16L,
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
)
TINY_GEMMA3 = dataclasses.replace(
    GEMMA3_1B,
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_layers=3,
    num_heads=4,
    head_dim=32,
    query_pre_attn_scalar=32.0,
    sliding_window=8,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
)
TINY_DEEPSEEK_V3 = dataclasses.replace(
    DEEPSEEK_V3_2L,
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_heads=4,
    num_kv_heads=4,
    head_dim=16,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    n_group=2,
    topk_group=1,
)
