"""Model configuration shared by the model, the checkpoint loaders and the runner."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder of one of the architectures in `checkpoints/architectures/`
    (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma 3, Mixtral, Qwen3-MoE,
    DeepSeek-V3, gpt-oss).

    Field names follow Hugging Face's configs where one exists, so `config.json` maps onto this
    class with few renames (see `from_hf_dict`). The fields after `architecture` switch the
    blocks a family adds to the Llama layer; their defaults are Llama's.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # Hugging Face's `rope_scaling` dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; from GGUF
    # also {"rope_type": "frequency_factors", "factors": [...]} (llama.cpp's rope_freqs tensor).
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    max_position_embeddings: int = 8192
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    qk_norm: bool = False  # RMS norms of each query and key head before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # norms of the attention and MLP outputs before their residual adds (Gemma 3)
    hidden_act: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    # Per layer "sliding_attention" or "full_attention" (None: every layer slides when
    # `sliding_window` is set). Sliding layers attend to the last `sliding_window` tokens.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of sliding layers, unscaled (None: as the others)
    # Mixture of experts (0 experts: a dense MLP in every layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    # DeepSeek-V3 (Hugging Face's names). Multi-head latent attention when kv_lora_rank > 0: queries
    # through a low-rank q_a/q_b pair (q_lora_rank; None: one q_proj), keys and values decompressed
    # per head from a cached latent of kv_lora_rank values plus one rotated key of qk_rope_head_dim
    # shared by all heads (`head_dim` is then qk_rope_head_dim, the RoPE's width, as in transformers).
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE over interleaved pairs (x0, x1), (x2, x3), ...
    # Its mixture of experts: "sigmoid" scores plus a learned bias choose (`e_score_correction_bias`)
    # within the top `topk_group` of `n_group` expert groups; weights times routed_scaling_factor;
    # `n_shared_experts` always-on experts; the first `first_k_dense_replace` layers dense.
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    num_nextn_predict_layers: int = 0  # multi-token prediction layers: loaded, run by MTP speculation only
    # gpt-oss (issue 52): a learned logit per query head in each attention softmax's denominator
    # (`layers/sinks`), a bias on o_proj too, and experts with biases whose gate and up units are
    # interleaved in one kernel, under a clamped SwiGLU (set `swiglu_limit`: `model/experts.py`).
    attention_sinks: bool = False
    attention_out_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    experts_mxfp4: bool = False  # the experts' kernels stored as MXFP4 blocks and scales (`checkpoints/mxfp4.py`)
    # Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next): `layer_types` entries "linear_attention" are
    # Gated DeltaNet layers (a conv and recurrent state per sequence), "full_attention" ones gated
    # attention (q_proj doubled: a sigmoid gate on each query feature's output) with RoPE on the first
    # head_dim * partial_rotary_factor features of each head. Hugging Face's names.
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    # The Gated DeltaNet conv channels' order: `linear_shards` groups (tensor-parallel shards), each the
    # queries, keys and values of its key heads; 1 (checkpoints' order): all queries, keys, values.
    linear_shards: int = 1
    shared_expert_intermediate_size: int = 0  # Qwen3-Next: a shared expert beside the routed ones, sigmoid-gated

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: silu, gelu_tanh")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} of {self.num_experts} experts")
        if self.kv_lora_rank % 2 or self.qk_rope_head_dim % 2:
            raise ValueError("kv_lora_rank and qk_rope_head_dim must be even (the latent is cached in two halves)")
        if self.num_experts and self.num_experts % self.n_group:
            raise ValueError(f"{self.num_experts} experts do not split into n_group {self.n_group} groups")
        if self.scoring_func == "sigmoid" and not (
            self.topk_group <= self.n_group and self.num_experts >= 2 * self.n_group
        ):  # a group scores the sum of its two best experts
            raise ValueError(
                f"topk_group {self.topk_group} of n_group {self.n_group} groups of {self.num_experts} experts: "
                "at most n_group groups of at least 2 experts each"
            )

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3): a latent per token cached, not K and V."""
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        """The layers with a mixture of experts (after the first dense ones)."""
        return self.num_layers - self.first_k_dense_replace if self.num_experts else 0

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.layer_types is not None:
            d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
