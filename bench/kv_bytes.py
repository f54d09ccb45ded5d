"""KV cache bytes per token of DeepSeek-V3 (multi-head latent attention) against the same model with
grouped-query or multi-head attention, from the cache layout the engine allocates
(`KVCache.bytes_per_block`), in bf16:

    python3 -m bench.kv_bytes

The configuration is DeepSeek-V3's published `config.json` (its numbers written here, no download).
The GQA variant keeps every layer and replaces MLA by 8 kv heads of 128 (Llama 3 70B's attention);
the MHA variant caches the keys and values MLA decompresses (128 heads of 192 + 128 values).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from checkpoints.architectures import config_from_hf
from checkpoints.config import ModelConfig
from jaxserve.model.kv_cache import KVCache

DEEPSEEK_V3_CONFIG = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
BLOCK = 16


def bytes_per_token(config: ModelConfig) -> int:
    """Cache bytes of one token over all layers, bf16, as the engine allocates them."""
    return KVCache.bytes_per_block(config, BLOCK, jnp.bfloat16) // BLOCK


def figures() -> list[tuple[str, int]]:
    """(attention, bytes per token) of DeepSeek-V3 with MLA, GQA and MHA caches."""
    mla = config_from_hf(DEEPSEEK_V3_CONFIG)
    gqa = dataclasses.replace(mla, kv_lora_rank=0, num_kv_heads=8, head_dim=128)
    mha_values = mla.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
    return [
        ("MLA: latent 512 + rope key 64", bytes_per_token(mla)),
        ("GQA: 8 kv heads x 128 (K and V)", bytes_per_token(gqa)),
        ("MHA: 128 heads x (192 K + 128 V)", mla.num_layers * mha_values * 2),
    ]


def main() -> None:
    rows = figures()
    mla = rows[0][1]
    print(f"DeepSeek-V3 ({DEEPSEEK_V3_CONFIG['num_hidden_layers']} layers), bf16 KV cache per token:")
    for name, n in rows:
        print(f"  {name:34s} {n:>10,d} B  {n / 1024:8.1f} KiB  {n / mla:5.2f}x MLA's")


if __name__ == "__main__":
    main()
