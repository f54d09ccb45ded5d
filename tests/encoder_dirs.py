"""Tiny random BERT directories in Hugging Face's layout, for the encoder tests and for the
cross-encoder reference (`tests/data/make_cross_encoder_reference.py` runs `write_cross_encoder`
with jaxserve's interpreter, then scores the same directory with transformers).

Weights are drawn from our declaration (`checkpoints.encoders.weights`, a fixed seed), so a test
writes the same directory again and no weights are committed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import tokenizers
from safetensors.numpy import save_file

from checkpoints.encoders import EncoderConfig
from checkpoints.encoders.weights import declare_encoder
from checkpoints.params import checkpoint_names, iter_leaves
from checkpoints.weights import flat, random_tree

TINY = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_len=64)
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
WORDS = "hello world ##s paris is the capital of france a dog cat sat on mat what where city river big".split()
CROSS_ENCODER_SEED = 3


def write_bert_weights(directory: Path, config: EncoderConfig, seed: int, prefix: str = "") -> dict:
    """`model.safetensors` of random weights drawn from the declaration, in Hugging Face's names
    (`prefix`: `bert.` for a `BertFor...` model, whose head names have none); the drawn params."""
    params = dict(iter_leaves(random_tree(declare_encoder(config), seed, np.float32)))
    tensors = {}
    for path, weight in flat(declare_encoder(config)).items():
        head = path.startswith(("pooler", "classifier"))
        for name, index in checkpoint_names(weight, weight.hf):
            part = params[path][index]
            key = name if head else prefix + name
            tensors[key] = np.ascontiguousarray(part.swapaxes(-1, -2) if weight.is_kernel else part)
    save_file(tensors, str(directory / "model.safetensors"))
    return params


def bert_config_json(config: EncoderConfig) -> dict:
    return {
        "model_type": "bert",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": "gelu",
    }


def write_wordpiece(directory: Path) -> None:
    """`tokenizer.json`: a WordPiece over `SPECIAL + WORDS` with BERT's single and pair templates,
    saved padded (as sentence-transformers' exports often are: the loader turns padding off)."""
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.enable_padding(length=16)
    tokenizer.save(str(directory / "tokenizer.json"))


def write_sentence_transformers(directory: Path, pooling: dict, normalize: bool, seed: int = 1) -> dict:
    """A sentence-transformers directory of a tiny random BERT embedding model; its params."""
    config = EncoderConfig("bert", **TINY, max_position_embeddings=64)
    params = write_bert_weights(directory, config, seed)
    (directory / "config.json").write_text(json.dumps(bert_config_json(config)))
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    if normalize:
        modules.append({"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    write_wordpiece(directory)
    return params


def write_cross_encoder(directory: Path, seed: int = CROSS_ENCODER_SEED) -> dict:
    """A tiny random `BertForSequenceClassification` of one label (a sentence-transformers
    `CrossEncoder` reranker's layout); its params."""
    directory.mkdir(parents=True, exist_ok=True)
    config = EncoderConfig("bert", **TINY, max_position_embeddings=64, pooling="cls", num_labels=1, sep_token_id=3)
    params = write_bert_weights(directory, config, seed, prefix="bert.")
    hf = bert_config_json(config) | {"architectures": ["BertForSequenceClassification"]}
    hf |= {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "type_vocab_size": 2}
    (directory / "config.json").write_text(json.dumps(hf))
    write_wordpiece(directory)
    return params


if __name__ == "__main__":
    write_cross_encoder(Path(sys.argv[1]))
