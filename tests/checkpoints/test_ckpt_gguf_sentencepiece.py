"""GGUF files with a SentencePiece ("llama") tokenizer, checked against the `sentencepiece` library.

A tiny SentencePiece BPE model (byte fallback, Llama's normalizer settings) is trained here on an
inline corpus; its pieces, scores and types go into a GGUF file as llama.cpp's converter writes
them, and the tokenizer we rebuild from that file must encode and decode as SentencePiece does.
"""

from __future__ import annotations

import io
import re

import gguf
import numpy as np
import pytest
import sentencepiece as spm
from ckpt_gguf_fixture import SentencePieceVocab, write_tiny_gguf
from sentencepiece import sentencepiece_model_pb2

from checkpoints.errors import UnsupportedCheckpointError
from checkpoints.gguf import load_gguf
from checkpoints.gguf_tokenizer import build_gguf_tokenizer, sentencepiece_merges
from checkpoints.loaded import LoadedModel
from checkpoints.orbax_io import load_orbax, save_orbax
from checkpoints.tiny_random import build_tiny_random
from jaxserve.tokenizer import Tokenizer

CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps; the fox thinks.
Hello world! This is a small corpus for training a tiny tokenizer, then testing it.
Numbers like 12345 and 3.14159 appear in text, as do dates: 2024-05-17 and times 10:30.
Le renard brun rapide saute par-dessus le chien paresseux. Ça va très bien, merci !
Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München, schön.
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca?
def main():\treturn tokenizer.encode(text, add_special_tokens=True)  # a code line
Tokenizers split text into pieces; sentencepiece treats spaces as ordinary symbols.
我们的模型很小。你好，世界。
Привет, мир! Как дела? Всё хорошо.
    indented code line with four spaces and    inner runs
the the the then there these those thin think thing things thought through throughout
""".splitlines()

TEXTS = [
    "Hello world!",
    "The quick brown fox thinks about the lazy dog.",
    "  leading spaces, trailing spaces   ",
    " one leading space",
    "tabs\tand\nnewlines\n\n and \r\n carriage returns",
    "digits 1234567890 and 3.14 and 2024-05-17",
    "Grüße aus München, Ça va très bien",
    "你好，世界！我们很好。",  # some characters only by byte fallback
    "emoji 🤗 and 👍🏽 and ∑ and ⁇",  # 4-byte characters, all by byte fallback
    "Привет, мир",
    "x",
    " ",
    "",
    "aaaa bbbb aaaaaa thethethe",
    "▁ is the space symbol itself",
]
SPECIAL_TEXTS = [
    "<s>[INST] Hello there [/INST] General Kenobi</s>",
    "a<tool>b <tool> c<tool>",
    "</s></s>x<s> y",
    "<unk> and <0x41> and <s",
]
USER_DEFINED = "<tool>"


def train_sentencepiece(add_dummy_prefix: bool = True) -> bytes:
    """A tiny SentencePiece BPE model proto with Llama's settings (byte fallback, split digits,
    identity normalization, whitespace kept as is)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 3), model_writer=model, model_type="bpe", vocab_size=420,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix, allow_whitespace_only_pieces=True, user_defined_symbols=[USER_DEFINED],
        character_coverage=0.99, num_threads=1, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    return model.getvalue()


def gguf_vocab(model_proto: bytes, **flags: bool | None) -> SentencePieceVocab:
    """What llama.cpp's converter stores: every piece with its score and type."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto)
    pieces = proto.pieces
    return SentencePieceVocab(
        tokens=[p.piece for p in pieces], scores=[p.score for p in pieces], types=[int(p.type) for p in pieces],
        bos_id=proto.trainer_spec.bos_id, eos_id=proto.trainer_spec.eos_id, unk_id=proto.trainer_spec.unk_id,
        **flags,
    )  # fmt: skip


def load_with_vocab(path, vocab: SentencePieceVocab) -> LoadedModel:
    write_tiny_gguf(path, build_tiny_random(vocab_size=len(vocab.tokens), intermediate_size=256), sentencepiece=vocab)
    return load_gguf(path)


@pytest.fixture(scope="module")
def proto() -> bytes:
    return train_sentencepiece()


@pytest.fixture(scope="module")
def sp(proto) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_proto=proto)


@pytest.fixture(scope="module")
def loaded(proto, tmp_path_factory) -> LoadedModel:
    return load_with_vocab(tmp_path_factory.mktemp("spm") / "m.gguf", gguf_vocab(proto))


def split_on_whole_tokens(text: str, whole: list[str]) -> list[str]:
    return [part for part in re.split("(" + "|".join(map(re.escape, whole)) + ")", text) if part]


def oracle_ids(sp: spm.SentencePieceProcessor, text: str) -> list[int]:
    """llama.cpp's rule, with SentencePiece doing the tokenizing: special and user-defined token
    strings are their ids, and each stretch of text between them is encoded on its own."""
    whole = ["<s>", "</s>", "<unk>", USER_DEFINED]
    ids: list[int] = []
    for part in split_on_whole_tokens(text, whole):
        ids += [sp.piece_to_id(part)] if part in whole else sp.encode(part)
    return ids


def test_vocabulary_exercises_every_path(proto, sp):
    """The oracle's vocabulary has what the tests rely on: byte pieces, multi-character merges,
    a user-defined piece, and characters of TEXTS that only byte fallback can spell."""
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert gguf_vocab(proto).types[sp.piece_to_id(USER_DEFINED)] == gguf.TokenType.USER_DEFINED
    assert sum(sp.is_byte(i) for i in range(len(pieces))) == 256
    assert any(len(p) >= 4 and not sp.is_byte(i) and p != USER_DEFINED for i, p in enumerate(pieces))
    assert sp.piece_to_id("我") == sp.unk_id() and sp.piece_to_id("你") != sp.unk_id()
    ids = [i for text in TEXTS for i in sp.encode(text)]
    assert sum(sp.is_byte(i) for i in ids) > 20


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_sentencepiece_with_bos(loaded, sp, text):
    tokenizer = loaded.tokenizer_bundle.tokenizer
    assert tokenizer.encode(text, add_special_tokens=True).ids == [sp.bos_id(), *sp.encode(text)]
    assert tokenizer.encode(text, add_special_tokens=False).ids == sp.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_sentencepiece(loaded, sp, text):
    ids = [sp.bos_id(), *sp.encode(text), sp.eos_id()]
    decoded = loaded.tokenizer_bundle.tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded == sp.decode(ids)
    assert decoded == text.replace("▁", " ")  # the space symbol in the text itself reads back as a space


@pytest.mark.parametrize("text", SPECIAL_TEXTS)
def test_special_token_strings_map_to_their_ids_as_in_llama_cpp(loaded, sp, text):
    ids = loaded.tokenizer_bundle.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == oracle_ids(sp, text)
    # Control tokens are dropped when decoding without special tokens; the user-defined one stays
    # (each stretch after a whole token decodes with the space its prefix stands for).
    decoded = loaded.tokenizer_bundle.tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded.replace(" ", "") == re.sub(r"</?s>|<unk>", "", text).replace(" ", "")


def test_chat_prompt_with_bos_text(loaded, sp):
    """A Llama 2 chat prompt renders BOS as text; it must become the BOS id, then the prompt
    tokenized as Meta's reference code does (SentencePiece on the text after it)."""
    tokenizer = loaded.tokenizer_bundle.tokenizer
    ids = tokenizer.encode("<s>[INST] Hi there [/INST]", add_special_tokens=False).ids
    assert ids == [sp.bos_id(), *sp.encode("[INST] Hi there [/INST]")]
    assert tokenizer.decode(ids) == "[INST] Hi there [/INST]"


def test_unknown_tokenizer_model_is_refused():
    with pytest.raises(UnsupportedCheckpointError, match="tokenizer model 'rwkv' is not supported"):
        build_gguf_tokenizer({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]}, "m.gguf")


def test_bundle_special_tokens_and_config(loaded, sp):
    bundle = loaded.tokenizer_bundle
    assert bundle.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert bundle.bos_token_id == sp.bos_id()
    assert bundle.eos_token_ids == (sp.eos_id(),) == loaded.config.eos_token_ids
    assert loaded.config.vocab_size == bundle.tokenizer.get_vocab_size() == sp.get_piece_size()


@pytest.mark.parametrize(("flags", "bos", "eos"), [({"add_bos": False, "add_eos": True}, [], [2]),
                                                   ({"add_bos": True, "add_eos": False}, [1], [])])  # fmt: skip
def test_add_bos_and_eos_flags(tmp_path, proto, sp, flags, bos, eos):
    tokenizer = load_with_vocab(tmp_path / "m.gguf", gguf_vocab(proto, **flags)).tokenizer_bundle.tokenizer
    for text in TEXTS[:3]:
        assert tokenizer.encode(text, add_special_tokens=True).ids == bos + sp.encode(text) + eos


def test_no_space_prefix(tmp_path):
    proto = train_sentencepiece(add_dummy_prefix=False)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    loaded = load_with_vocab(tmp_path / "m.gguf", gguf_vocab(proto, add_space_prefix=False))
    tokenizer = loaded.tokenizer_bundle.tokenizer
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert tokenizer.decode(ids) == sp.decode(ids) == text.replace("▁", " ")
    assert tokenizer.encode("Hello", add_special_tokens=False).ids[0] != sp.piece_to_id("▁H")


def test_converted_checkpoint_keeps_the_tokenizer(loaded, sp, tmp_path):
    """`jaxserve convert` stores the rebuilt tokenizer as tokenizer.json; it must survive the trip."""
    save_orbax(loaded, tmp_path / "converted")
    tokenizer = load_orbax(tmp_path / "converted").tokenizer_bundle.tokenizer
    for text in TEXTS + SPECIAL_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=True).ids
        assert ids == loaded.tokenizer_bundle.tokenizer.encode(text, add_special_tokens=True).ids
        assert tokenizer.decode(ids) == loaded.tokenizer_bundle.tokenizer.decode(ids)


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    detokenizer = tokenizer.detokenizer(skip_special_tokens=True)
    return [detokenizer.add(i) for i in ids] + [detokenizer.finish()]


@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS)
def test_incremental_detokenizer_matches_full_decode(loaded, text):
    tokenizer = Tokenizer(loaded.tokenizer_bundle)
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)


def test_byte_fallback_character_streams_once_complete(loaded, sp):
    tokenizer = Tokenizer(loaded.tokenizer_bundle)
    ids = tokenizer.encode("a 我我 🤗!")  # 我 is 3 byte tokens, 🤗 is 4
    assert sum(sp.is_byte(i) for i in ids) == 10
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == "a 我我 🤗!"
    assert [d for d in deltas if d] == ["a", " ", "我", "我", " ", "🤗", "!"]
    assert not any("\ufffd" in d for d in deltas)


def byte_ids(sp: spm.SentencePieceProcessor, data: bytes) -> list[int]:
    return [sp.piece_to_id(f"<0x{b:02X}>") for b in data]


def random_stream(sp: spm.SentencePieceProcessor, rng: np.random.Generator) -> list[int]:
    """Ids a model may sample: pieces, control tokens and whole characters spelled in byte tokens."""
    pieces = [i for i in range(sp.get_piece_size()) if not (sp.is_byte(i) or sp.is_control(i))]
    ids: list[int] = []
    for _ in range(int(rng.integers(1, 10))):
        kind = rng.choice(["piece", "control", "char"], p=[0.5, 0.1, 0.4])
        if kind == "piece":
            ids.append(int(rng.choice(pieces)))
        elif kind == "control":
            ids.append(int(rng.choice([sp.bos_id(), sp.eos_id()])))
        else:
            low, high = [(0x80, 0x800), (0x4E00, 0x9FFF), (0x1F300, 0x1F64F)][rng.integers(3)]  # 2, 3, 4 bytes
            ids += byte_ids(sp, chr(int(rng.integers(low, high))).encode("utf-8"))
    return ids


def test_incremental_detokenizer_on_random_ids(loaded, sp):
    tokenizer = Tokenizer(loaded.tokenizer_bundle)
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = random_stream(sp, rng)
        assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids), ids


@pytest.mark.parametrize(("tail", "text"), [(b"\xff", "ok"), (b"\xe4\xbd", "")],
                         ids=["stray-byte-then-text", "ends-inside-a-char"])  # fmt: skip
def test_incremental_detokenizer_after_an_invalid_byte_run(loaded, sp, tail, text):
    """A complete character spelled in bytes, then bytes that cannot continue it: what a model may
    sample. tokenizers' full decode turns the whole byte run into U+FFFD; the stream keeps the
    character it already showed and marks only the bad bytes, as sentencepiece does."""
    tokenizer = Tokenizer(loaded.tokenizer_bundle)
    ids = byte_ids(sp, "我".encode() + tail) + sp.encode(text)
    assert "".join(stream(tokenizer, ids)) == sp.decode(ids)


def test_the_first_generated_word_keeps_its_space_after_a_prompt(loaded, sp):
    """SentencePiece's decoder drops a leading space; with the prompt as context it is kept."""
    tokenizer = Tokenizer(loaded.tokenizer_bundle)
    prompt, reply = tokenizer.encode("The capital of France is", add_special_tokens=True), sp.encode("Paris.")
    detokenizer = tokenizer.detokenizer(context=prompt)
    text = "".join(detokenizer.add(i) for i in reply) + detokenizer.finish()
    assert text == " Paris." == tokenizer.decode(prompt + reply)[len(tokenizer.decode(prompt)) :]
    assert "".join(stream(tokenizer, reply)) == "Paris."  # without context, as decode(reply)


def test_merges_follow_piece_scores():
    """Every split of a normal piece into two normal pieces, best-scoring result first; control,
    byte and unused pieces take no part."""
    tokens = ["<s>", "<0x61>", "a", "b", "c", "ab", "bc", "abc", "ca", "<s>a", "cab"]
    scores = [0.0, 0.0, -10.0, -11.0, -12.0, -1.0, -2.0, -3.0, -0.9, -0.5, -0.1]
    types = [3, 6, 1, 1, 1, 1, 1, 1, 1, 1, 5]
    assert sentencepiece_merges(tokens, scores, types) == [
        ("c", "a"), ("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c"),
    ]  # fmt: skip


def test_missing_scores_are_refused(tmp_path, proto):
    vocab = gguf_vocab(proto)
    bad = SentencePieceVocab(tokens=vocab.tokens, scores=vocab.scores[:-1], types=vocab.types)
    with pytest.raises(UnsupportedCheckpointError, match="tokenizer.ggml.scores"):
        load_with_vocab(tmp_path / "m.gguf", bad)


def test_completion_prompts_get_a_bos_and_rendered_chats_keep_their_own(loaded, sp):
    """Text prompts are completions: the tokenizer's BOS is added (as vLLM and HF do for Llama 2).
    A rendered chat writes `<s>` itself, so `LLM.chat` passes ids and no second BOS appears."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine

    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, block_size=8, num_blocks=32)
    engine = LLMEngine(loaded, config)
    assert engine.encode_prompt("Hello world") == [sp.bos_id(), *sp.encode("Hello world")]
    tokenizer = Tokenizer(loaded.tokenizer_bundle)
    assert tokenizer.encode("<s>[INST] Hi [/INST]").count(sp.bos_id()) == 1
