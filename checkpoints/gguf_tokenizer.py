"""A `tokenizers.Tokenizer` rebuilt from the vocabulary and merges stored in a GGUF file.

GGUF keeps no `tokenizer.json`: only the vocabulary, the merges, the token types and the name of
llama.cpp's pre-tokenizer (`tokenizer.ggml.pre`). Each pre-tokenizer name stands for the text
splitting of the original Hugging Face tokenizer, which we rebuild here:

- `smollm` (also StarCoder's): every digit on its own, then GPT-2's byte-level regex. This is
  `Digits(individual_digits=True)` + `ByteLevel` in SmolLM2's own `tokenizer.json`, and the two
  regexes llama.cpp applies for this type. (transformers' GGUF loader does not know `smollm` and
  falls back to plain GPT-2 splitting, which differs when a run of 2+ whitespace characters
  precedes a digit: "  42" gives `ĠĠ 4 2` here and `Ġ Ġ 4 2` there.)
- `default` / `gpt-2`: GPT-2's byte-level regex.
- `llama-bpe` (Llama 3) and `qwen2`: their published split regexes, then byte-level mapping.

`tokenizer.ggml.model == "llama"` files (Llama 2, Mistral 7B v0.1/v0.2, TinyLlama, ...) hold a
SentencePiece BPE vocabulary instead: pieces, scores and token types, but no merges. See
`_sentencepiece_bpe` for how that becomes a `tokenizers` BPE, and where it differs from
SentencePiece itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from checkpoints.errors import UnsupportedCheckpointError

# llama.cpp's token types (gguf.TokenType; the same numbers as SentencePiece's piece types).
_NORMAL = 1
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4
# SentencePiece's whitespace symbol, U+2581.
_SPACE = "\u2581"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(regex: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2,
    "gpt-2": _gpt2,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_gguf_tokenizer(metadata: dict[str, Any], source: str) -> Tokenizer:
    """Build the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2":
        return _byte_level_bpe(metadata, source)
    if model == "llama":
        return _sentencepiece_bpe(metadata, source)
    raise UnsupportedCheckpointError(
        f"{source}: tokenizer model {model!r} is not supported from GGUF (only byte-level BPE, 'gpt2', and "
        "SentencePiece BPE, 'llama'); load the model from a Hugging Face directory with tokenizer.json instead"
    )


def _byte_level_bpe(metadata: dict[str, Any], source: str) -> Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedCheckpointError(
            f"{source}: GGUF pre-tokenizer {pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types = _token_types(metadata)
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]

    # Tokens are stored in the byte-level spelling, except a few added tokens written as plain
    # text; spell those in the alphabet too so every vocabulary entry is reachable.
    byte_map = _byte_to_unicode()
    alphabet = set(byte_map.values())
    spelled = [t if set(t) <= alphabet else "".join(byte_map[b] for b in t.encode("utf-8")) for t in tokens]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) and user-defined ones must match whole in the text.
    # A control token outside the alphabet was respelled above; it cannot be matched as text.
    _add_whole_tokens(tokenizer, tokens, token_types, {_CONTROL}, keep=lambda t: set(t) <= alphabet)
    tokenizer.post_processor = _post_processor(metadata, tokens, add_bos_by_default=False)
    return tokenizer


def _sentencepiece_bpe(metadata: dict[str, Any], source: str) -> Tokenizer:
    """A Llama-style SentencePiece BPE tokenizer (byte fallback), as `LlamaTokenizerFast` builds it.

    Text is normalized as SentencePiece does with Llama's normalizer spec (identity rules, no
    whitespace collapsing): spaces become "▁" and, unless `tokenizer.ggml.add_space_prefix` is
    false, one "▁" is prepended. Characters outside the vocabulary become `<0xNN>` byte tokens.
    Decoding undoes this and strips the prepended space.

    Matches `sentencepiece` on plain text. Differences, shared with llama.cpp and Hugging Face's
    legacy Llama tokenizer:
    - Control, unknown and user-defined token strings in the text (`<s>`, `</s>`, ...) map to
      their ids, and the text after each gets its own "▁" prefix, as if encoded separately
      (SentencePiece reads control-token strings as plain text and keeps user-defined ones inline).
    - No merge makes a piece of type UNUSED: SentencePiece merges into them and then splits them
      back, which a merge list cannot express; here those merges are left out.
    - Two different splits of one piece overlapping in the text (e.g. "a"+"aa" and "aa"+"a" of
      "aaa") are tried in a fixed order rather than leftmost first.
    - tokenizers' ByteFallback decoder (Hugging Face's too) reads a run of byte tokens all or
      nothing: one byte that is not valid UTF-8 there turns the whole run into U+FFFD, where
      SentencePiece replaces only the bad bytes. A model sampling such a run breaks `DecodeStream`.
    """
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    scores: list[float] | None = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise UnsupportedCheckpointError(
            f"{source}: a SentencePiece ('llama') vocabulary needs one tokenizer.ggml.scores entry per token "
            "to rebuild its merges"
        )
    token_types = _token_types(metadata)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=sentencepiece_merges(tokens, scores, token_types),
            unk_token=None if unk_id is None else tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    prefix = [normalizers.Prepend(_SPACE)] if add_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", _SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    _add_whole_tokens(tokenizer, tokens, token_types, {_CONTROL, _UNKNOWN}, keep=bool)
    tokenizer.post_processor = _post_processor(metadata, tokens, add_bos_by_default=True)
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges implied by a SentencePiece BPE vocabulary, highest priority first.

    SentencePiece BPE repeatedly joins the adjacent pair whose concatenation is the
    highest-scoring normal piece. So every split of a normal piece into two normal pieces is a
    merge, ranked by the score of the piece it makes; ties go to the lower ids, as in Hugging
    Face's `SentencePieceExtractor`.
    """
    ids = {t: i for i, t in enumerate(tokens) if token_types[i] == _NORMAL}
    ranked = [
        (-scores[merged_id], merged_id, ids[merged[:cut]], ids[merged[cut:]], merged[:cut], merged[cut:])
        for merged, merged_id in ids.items()
        for cut in range(1, len(merged))
        if merged[:cut] in ids and merged[cut:] in ids
    ]
    ranked.sort(key=lambda entry: entry[:4])
    return [(left, right) for *_, left, right in ranked]


def _token_types(metadata: dict[str, Any]) -> list[int]:
    return metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(metadata["tokenizer.ggml.tokens"])


def _add_whole_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int], special_types: set[int],
                      keep: Callable[[str], bool]) -> None:  # fmt: skip
    """Make tokens of `special_types` (special) and user-defined ones (not special) match whole
    in the raw text, before normalization and splitting; `keep` filters out unmatchable ones."""

    def whole(kinds: set[int], special: bool) -> list[AddedToken]:
        return [
            AddedToken(t, special=special, normalized=False)
            for t, kind in zip(tokens, token_types)
            if kind in kinds and keep(t)
        ]

    tokenizer.add_special_tokens(whole(special_types, True))
    tokenizer.add_tokens(whole({_USER_DEFINED}, False))


def _post_processor(metadata: dict[str, Any], tokens: list[str], add_bos_by_default: bool) -> processors.PostProcessor:
    """Add BOS/EOS around encoded text (with add_special_tokens=True) as the file asks; without
    `add_bos_token`, SentencePiece files add BOS (as `LlamaTokenizerFast` does), others do not."""
    single = ["$A"]
    special: list[tuple[str, int]] = []
    for flag, key, default in (("add_bos_token", "bos_token_id", add_bos_by_default),
                               ("add_eos_token", "eos_token_id", False)):  # fmt: skip
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if metadata.get(f"tokenizer.ggml.{flag}", default) and token_id is not None:
            single.insert(0 if key == "bos_token_id" else len(single), tokens[token_id])
            special.append((tokens[token_id], token_id))
    return processors.TemplateProcessing(single=" ".join(single), special_tokens=special)
