"""`tiny-random`: a deterministic random tiny Llama with a small byte-level BPE tokenizer.

Everything is built in code (no download), so unit tests of the model, the runner and the
server can load a complete model in milliseconds. The weights are drawn with a fixed seed from
the architecture's declaration (`checkpoints.weights`: scaled like a trained network, with
unit-variance activations), so logits are far from uniform and greedy decoding is not dominated
by ties. Overrides make tiny models of the other families (`architecture="qwen3"`, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from checkpoints.architectures import declare, gpt_oss
from checkpoints.config import ModelConfig
from checkpoints.loaded import LoadedModel
from checkpoints.params import ParamTree, resolve_dtype
from checkpoints.tokenizer_bundle import TokenizerBundle
from checkpoints.weights import random_tree

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_VOCAB_SIZE = 300
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "system user assistant: You are a helpful assistant. The answer is in the question.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n",
    "你好，世界。今天天气很好。",
    "Streaming text arrives token by token; the model writes one word at a time.",
)


def build_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE with 300 tokens (3 special, 256 bytes, 41 merges) trained on a fixed corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_CORPUS) * 3, trainer=trainer)
    return tokenizer


def tiny_random_config(**overrides: Any) -> ModelConfig:
    """The tiny-random config; pass overrides (e.g. attention_bias=True) for other variants."""
    fields: dict[str, Any] = dict(
        vocab_size=_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        bos_token_id=SPECIAL_TOKENS.index("<|im_start|>"),
        eos_token_ids=(SPECIAL_TOKENS.index("<|im_end|>"),),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


# Tiny configs of each family (overrides of `tiny_random_config`): every block the family switches
# on, at sizes where a test runs in seconds. The windows (8 tokens) are shorter than test prompts.
# Their heads are untied: random tied embeddings make greedy decoding repeat the last token (its
# own embedding dominates its logits); the real models test tied heads.
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"architecture": "qwen2", "attention_bias": True},
    "qwen3": {"architecture": "qwen3", "qk_norm": True, "head_dim": 32},
    "mistral": {"architecture": "mistral", "sliding_window": 8},
    "gemma3": {
        "architecture": "gemma3",
        "num_layers": 3,
        "num_kv_heads": 1,
        "head_dim": 32,
        "qk_norm": True,
        "post_norms": True,
        "hidden_act": "gelu_tanh",
        "scale_embeddings": True,
        "query_pre_attn_scalar": 24.0,
        "sliding_window": 8,
        "layer_types": ("sliding_attention", "full_attention", "sliding_attention"),
        "rope_theta": 1_000_000.0,
        "rope_local_theta": 10_000.0,
        "rms_norm_eps": 1e-6,
    },
    "mixtral": {
        "architecture": "mixtral",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 96,
        "moe_intermediate_size": 96,
    },
    "qwen3_moe": {
        "architecture": "qwen3_moe",
        "qk_norm": True,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-6,
    },
    "deepseek_v3": {
        "architecture": "deepseek_v3",
        "num_layers": 3,
        "num_kv_heads": 4,
        "head_dim": 8,
        "kv_lora_rank": 24,
        "q_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "rope_interleave": True,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
        "scoring_func": "sigmoid",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-6,
    },
    # gpt-oss's blocks at the real model's RoPE; a SwiGLU limit of 1 so the clamps bite.
    "gpt_oss": {
        "architecture": "gpt_oss",
        "attention_bias": True,
        "attention_out_bias": True,
        "attention_sinks": True,
        "sliding_window": 8,
        "layer_types": ("sliding_attention", "full_attention"),
        "rope_theta": gpt_oss.DEFAULT_THETA,
        "max_position_embeddings": 131_072,
        "rope_scaling": dict(gpt_oss.DEFAULT_ROPE),
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "moe_intermediate_size": 32,
        "swiglu_limit": 1.0,
    },
    "qwen3_5": {  # three Gated DeltaNet layers, then gated full attention
        "architecture": "qwen3_5",
        "num_layers": 4,
        "layer_types": ("linear_attention",) * 3 + ("full_attention",),
        "qk_norm": True,
        "attn_output_gate": True,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
}
# Qwen3-Next: Qwen3.5's layers with a mixture of experts and a shared expert in each.
TINY_FAMILIES["qwen3_next"] = {
    **TINY_FAMILIES["qwen3_5"],
    "architecture": "qwen3_next",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
# The same gpt-oss with its experts stored as real checkpoints store them: MXFP4 blocks and scales.
TINY_FAMILIES["gpt_oss_mxfp4"] = {**TINY_FAMILIES["gpt_oss"], "experts_mxfp4": True}


def random_params(config: ModelConfig, seed: int = 0, dtype: Any = "float32") -> ParamTree:
    """Random parameters for `config`, drawn as its declaration says. Same seed, same arrays.
    MXFP4 experts (gpt-oss) are the float model's, quantized."""
    if config.experts_mxfp4:
        float_config = dataclasses.replace(config, experts_mxfp4=False)
        return gpt_oss.with_mxfp4_experts(random_params(float_config, seed, dtype))
    return random_tree(declare(config), seed, resolve_dtype(dtype))


def build_tiny_random(
    dtype: Any = "float32", seed: int = 0, family: str = "llama", **config_overrides: Any
) -> LoadedModel:
    """The complete tiny-random model of a family (`TINY_FAMILIES`): config, parameters and tokenizer bundle."""
    config = tiny_random_config(**{**TINY_FAMILIES[family], **config_overrides})
    tokenizer = build_tiny_tokenizer()
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise ValueError(f"vocab_size {config.vocab_size} < tokenizer size {tokenizer.get_vocab_size()}")
    bundle = TokenizerBundle(
        tokenizer=tokenizer,
        chat_template=CHATML_TEMPLATE,
        special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"},
        eos_token_ids=config.eos_token_ids,
    )
    return LoadedModel(config=config, params=random_params(config, seed, dtype), tokenizer_bundle=bundle)
