"""Write a small GGUF file the way llama.cpp's converter would, for loader tests.

Weights are written in Hugging Face orientation (`[out, in]`), with the Q/K rows permuted for
llama.cpp's interleaved RoPE when the architecture is `llama`, and each tensor quantized to a
chosen type. The function returns what a correct loader must produce: the dequantized weights in
Hugging Face orientation and layout (un-permuted), keyed by GGUF tensor name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np

from checkpoints.architectures import declare
from checkpoints.loaded import LoadedModel
from checkpoints.params import checkpoint_names, iter_leaves
from checkpoints.weights import flat

Q = gguf.GGMLQuantizationType

# Default type per tensor kind: every supported type appears at least once.
DEFAULT_TYPES = {
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.F32,
    "output_norm.weight": Q.F32,
    "attn_norm.weight": Q.F32,
    "ffn_norm.weight": Q.F32,
    "attn_q.weight": Q.Q4_0,
    "attn_k.weight": Q.Q4_1,
    "attn_v.weight": Q.F16,
    "attn_output.weight": Q.BF16,
    "ffn_gate.weight": Q.Q8_0,
    "ffn_up.weight": Q.Q4_1,
    "ffn_down.weight": Q.Q6_K,
    "attn_q.bias": Q.F32,
    "attn_k.bias": Q.F32,
    "attn_v.bias": Q.F32,
}
K_QUANTS = {Q.Q4_K, Q.Q6_K}
# Byte offsets of the float16 super-block scales in one K-quant block.
_K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (interleaves the two halves of each head)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_weights(model: LoadedModel) -> dict[str, np.ndarray]:
    """The model's parameters under GGUF tensor names (its architecture's declared ones), in
    Hugging Face orientation."""
    leaves = dict(iter_leaves(model.params))
    out = {}
    for path, weight in flat(declare(model.config)).items():
        for name, index in checkpoint_names(weight, weight.gguf):
            value = leaves[path][index]
            out[name] = value.swapaxes(-1, -2) if weight.is_kernel else value
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def _random_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in `qtype`'s block layout, with every float16 (its scales) a small number."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems * block_bytes), dtype=np.uint8)
    halves = raw.view(np.float16)
    halves[~np.isfinite(halves) | (np.abs(halves) > 1)] = np.float16(0.01)
    return raw


def _random_k_quant(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        raw[:, :, offset : offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


@dataclasses.dataclass(frozen=True)
class SentencePieceVocab:
    """A SentencePiece vocabulary as llama.cpp's converter stores it (`tokenizer.ggml.model = "llama"`).
    The flags are written only when not None, as older files lack them."""

    tokens: list[str]
    scores: list[float]
    types: list[int]  # SentencePiece piece types, numbered as gguf.TokenType
    bos_id: int = 1
    eos_id: int = 2
    unk_id: int = 0
    add_bos: bool | None = None
    add_eos: bool | None = None
    add_space_prefix: bool | None = None


def _write_gpt2_vocab(writer: gguf.GGUFWriter, model: LoadedModel, pre: str) -> None:
    tokenizer = model.tokenizer_bundle.tokenizer
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    specials = set(model.tokenizer_bundle.special_tokens.values())
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]])
    writer.add_bos_token_id(vocab[model.tokenizer_bundle.special_tokens["bos_token"]])
    writer.add_eos_token_id(vocab[model.tokenizer_bundle.special_tokens["eos_token"]])


def _write_sentencepiece_vocab(writer: gguf.GGUFWriter, vocab: SentencePieceVocab) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_unk_token_id(vocab.unk_id)
    for value, add in ((vocab.add_bos, writer.add_add_bos_token), (vocab.add_eos, writer.add_add_eos_token),
                       (vocab.add_space_prefix, writer.add_add_space_prefix)):  # fmt: skip
        if value is not None:
            add(value)


def write_tiny_gguf(
    path: Path,
    model: LoadedModel,
    arch: str = "llama",
    types: dict[str, Q] | None = None,
    pre: str = "smollm",
    skip: tuple[str, ...] = (),
    rope_factors: np.ndarray | None = None,
    yarn: tuple[float, int] | None = None,
    sentencepiece: SentencePieceVocab | None = None,
) -> dict[str, np.ndarray]:
    """Write `model` as a GGUF file; return the expected dequantized HF-layout weights by name.
    `rope_factors` become a `rope_freqs.weight` tensor, as in llama.cpp's Llama 3.1 files;
    `yarn` (factor, original context length) is written as llama.cpp's YaRN scaling keys.
    The tokenizer is the model's own (byte-level BPE, split as `pre` names), or `sentencepiece`."""
    types = {**DEFAULT_TYPES, **(types or {})}
    config = model.config
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    if yarn is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn[0])
        writer.add_rope_scaling_orig_ctx_len(yarn[1])
    if sentencepiece is None:
        _write_gpt2_vocab(writer, model, pre)
    else:
        _write_sentencepiece_vocab(writer, sentencepiece)
    writer.add_chat_template(model.tokenizer_bundle.chat_template)

    expected = {}
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    for name, weight in hf_weights(model).items():
        if name in skip:
            continue
        kind = name.split(".", 2)[-1] if name.startswith("blk.") else name
        qtype = types[kind]
        if qtype in K_QUANTS:
            raw = _random_k_quant(*weight.shape, qtype, rng)
        elif qtype == Q.F32:
            raw = weight
        else:
            try:
                raw = gguf.quants.quantize(weight, qtype)
            except NotImplementedError:  # no quantizer in gguf-py: random blocks
                raw = _random_blocks(*weight.shape, qtype, rng)
        try:
            expected[name] = raw if qtype == Q.F32 else gguf.quants.dequantize(raw, qtype)
        except NotImplementedError:  # a type the loader must refuse
            pass
        head_count = heads.get(kind.split(".")[0])
        if arch == "llama" and head_count:
            # Quantization works on rows of the input dim, so it commutes with this row permutation.
            raw = llama_cpp_permute(raw, head_count)
        writer.add_tensor(name, raw, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_factors, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
