"""BERT's WordPiece tokenizer, from a `tokenizer.json` or from a GGUF file's vocabulary.

An embedding model's tokenizer must not pad or truncate (sentence-transformers' exports often save
`tokenizer.json` with padding to 128 and truncation on): the server checks lengths and refuses
over-long inputs instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from checkpoints.errors import CheckpointError
from checkpoints.tokenizer_bundle import TokenizerBundle

_SPECIAL = 3  # llama.cpp's token type of control tokens
_WORD_START = "\u2581"  # llama.cpp's converter marks word-initial pieces with it, and drops "##"


def _bundle(tokenizer: tokenizers.Tokenizer) -> TokenizerBundle:
    tokenizer.no_padding()
    tokenizer.no_truncation()
    special = {"unk_token": "[UNK]", "pad_token": "[PAD]"}
    return TokenizerBundle(tokenizer=tokenizer, chat_template=None, special_tokens=special, eos_token_ids=())


def bundle_from_file(directory: Path) -> TokenizerBundle:
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{directory}: no tokenizer.json")
    try:
        return _bundle(tokenizers.Tokenizer.from_file(str(file)))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise CheckpointError(f"{file}: cannot parse tokenizer: {e}") from e


def wordpiece_from_gguf(meta: dict[str, Any], source: str) -> TokenizerBundle:
    """BERT's uncased WordPiece over a GGUF vocabulary (`tokenizer.ggml.model` "bert")."""
    if meta.get("tokenizer.ggml.model") != "bert":
        raise CheckpointError(f"{source}: tokenizer {meta.get('tokenizer.ggml.model')!r}; a BERT WordPiece is expected")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind == _SPECIAL or token.startswith("[unused"):
            piece = token
        else:
            piece = token[1:] if token.startswith(_WORD_START) else "##" + token
        vocab.setdefault(piece, i)
    unk = tokens[int(meta.get("tokenizer.ggml.unknown_token_id", 100))]
    cls, sep = tokens[int(meta["tokenizer.ggml.bos_token_id"])], tokens[int(meta["tokenizer.ggml.seperator_token_id"])]
    tokenizer = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens([t for t, k in zip(tokens, types) if k == _SPECIAL])
    return _bundle(tokenizer)
