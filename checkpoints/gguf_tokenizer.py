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
"""

from __future__ import annotations

from typing import Any, Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from checkpoints.errors import UnsupportedCheckpointError

# llama.cpp's token types (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4

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
    if model != "gpt2":
        raise UnsupportedCheckpointError(
            f"{source}: tokenizer model {model!r} is not supported from GGUF (only byte-level BPE, 'gpt2'); "
            "load the model from a Hugging Face directory with tokenizer.json instead"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedCheckpointError(
            f"{source}: GGUF pre-tokenizer {pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
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
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, token_types)
            if kind == _CONTROL and set(t) <= alphabet
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_types)
            if kind == _USER_DEFINED and set(t) <= alphabet
        ]
    )
    tokenizer.post_processor = _post_processor(metadata, tokens)
    return tokenizer


def _post_processor(metadata: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """Add BOS/EOS around encoded text (with add_special_tokens=True) as the file asks."""
    single = ["$A"]
    special: list[tuple[str, int]] = []
    for flag, key, position in (("add_bos_token", "bos_token_id", 0), ("add_eos_token", "eos_token_id", 1)):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if metadata.get(f"tokenizer.ggml.{flag}") and token_id is not None:
            single.insert(0 if position == 0 else len(single), tokens[token_id])
            special.append((tokens[token_id], token_id))
    return processors.TemplateProcessing(single=" ".join(single), special_tokens=special)
