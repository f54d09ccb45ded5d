"""The configuration of a BERT-family encoder, and what sentence-transformers adds on top of it
(the pooling and whether embeddings are normalised), or the classifier head of a cross-encoder."""

from __future__ import annotations

import dataclasses

POOLING_KINDS = ("mean", "cls", "last")
SCORE_ACTIVATIONS = ("sigmoid", "identity")
ARCHITECTURES = ("bert", "nomic_bert")


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """Hyper-parameters of an encoder.

    `bert`: absolute position embeddings, separate q/k/v with biases, GELU (erf) MLP.
    `nomic_bert`: rotary positions (NeoX halves), a fused qkv projection and SwiGLU, no biases.
    Both: token-type embeddings, post-LayerNorm blocks, bidirectional attention.

    `max_len`: the longest input served (sentence-transformers' `max_seq_length` where it gives
    one, else the model's context). `pooling` / `normalize`: from `1_Pooling/config.json` and a
    `Normalize` module in `modules.json` (GGUF: `pooling_type`; embeddings normalised).
    `matryoshka`: the model was trained so that its embeddings may be shortened (`dimensions`).
    `num_labels`: 0 for an embedding model; 1 for a cross-encoder (`BertForSequenceClassification`,
    e.g. sentence-transformers' `CrossEncoder` rerankers): BERT's pooler (dense + tanh over the CLS
    row) and a classifier score a pair of texts, `[CLS] a [SEP] b [SEP]`, whose second segment
    (token type 1) starts after the first `[SEP]` (`sep_token_id`). `score_activation`: what turns its
    logit into the served score (sentence-transformers' `activation_fn`: a sigmoid unless it says identity).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_len: int
    type_vocab_size: int = 2
    max_position_embeddings: int = 512
    layer_norm_eps: float = 1e-12
    rope_theta: float = 10000.0
    pooling: str = "mean"
    normalize: bool = True
    matryoshka: bool = False
    num_labels: int = 0
    sep_token_id: int | None = None
    score_activation: str = "sigmoid"

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported encoder architecture {self.architecture!r}; supported: {ARCHITECTURES}")
        if self.pooling not in POOLING_KINDS:
            raise ValueError(f"unsupported pooling {self.pooling!r}; supported: {POOLING_KINDS}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_labels not in (0, 1):
            raise ValueError(f"a classifier of {self.num_labels} labels: one label (a relevance score) is served")
        if self.score_activation not in SCORE_ACTIVATIONS:
            raise ValueError(f"unsupported score activation {self.score_activation!r}; supported: {SCORE_ACTIVATIONS}")
        if self.num_labels and (self.pooling != "cls" or self.sep_token_id is None):
            raise ValueError("a cross-encoder pools the CLS row and needs its [SEP] token id")
        if self.architecture == "bert" and self.max_len > self.max_position_embeddings:
            raise ValueError(f"max_len {self.max_len} exceeds the {self.max_position_embeddings} position embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def is_cross_encoder(self) -> bool:
        return self.num_labels > 0

    @property
    def rotary(self) -> bool:
        return self.architecture == "nomic_bert"
