"""`tiny-random`: a deterministic random tiny Llama with a small byte-level BPE tokenizer.

Everything is built in code (no download), so unit tests of the model, the runner and the
server can load a complete model in milliseconds. The weights are drawn with a fixed seed and
scaled like a trained network (unit-variance activations), so logits are far from uniform and
greedy decoding is not dominated by ties.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from checkpoints.config import ModelConfig
from checkpoints.loaded import LoadedModel
from checkpoints.params import ParamTree, iter_leaves, param_shapes, resolve_dtype
from checkpoints.tokenizer_bundle import TokenizerBundle

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


def scale_like_trained(leaf: str, noise: Any, shape: tuple[int, ...]) -> Any:
    """The values of a leaf named `leaf` (kernel, scale, bias, embedding) from standard-normal
    `noise` of `shape` (numpy or jax): kernels ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm
    scales ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2)."""
    if leaf == "kernel":
        return noise / np.sqrt(shape[-2])
    if leaf == "scale":
        return 1.0 + 0.1 * noise
    if leaf == "bias":
        return 0.1 * noise
    return noise


def random_params(config: ModelConfig, seed: int = 0, dtype: Any = "float32") -> ParamTree:
    """Random parameters for `config`, scaled as `scale_like_trained` says. Same seed, same arrays."""
    rng = np.random.default_rng(seed)
    dtype = resolve_dtype(dtype)
    flat: dict[str, np.ndarray] = {}
    for path, shape in iter_leaves(param_shapes(config)):
        noise = rng.standard_normal(shape, dtype=np.float32)
        flat[path] = scale_like_trained(path.rsplit("/", 1)[1], noise, shape).astype(dtype)
    tree: ParamTree = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def build_tiny_random(dtype: Any = "float32", seed: int = 0, **config_overrides: Any) -> LoadedModel:
    """The complete tiny-random model: config, parameters and tokenizer bundle."""
    config = tiny_random_config(**config_overrides)
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
