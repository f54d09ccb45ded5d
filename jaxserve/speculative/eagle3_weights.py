"""An EAGLE-3 head's weights (host side, numpy): the safetensors of vLLM's and SpecForge's layout, read into the
parameters `eagle3_model.eagle3_forward` takes.

Names (an optional `model.` prefix is dropped): `fc.weight` [E, 3 E_target]; `midlayer.input_layernorm`,
`midlayer.hidden_norm`, `midlayer.post_attention_layernorm`, `norm` (`.weight` [E] each);
`midlayer.self_attn.{q,k,v}_proj.weight` [out, 2 E] and `o_proj.weight` [E, heads * head_dim];
`midlayer.mlp.{gate,up,down}_proj.weight`; `lm_head.weight` [draft_vocab, E]; `d2t` (int64 [draft_vocab]: a draft
id d is the target id d + d2t[d]; absent only when the draft vocabulary is the target's); `t2d` (bool [V],
not needed to draft: only its shape is checked); `embed_tokens.weight` [V, E] optional (absent: the target's
embedding is shared). Kernels are stored transposed, [in, out], as the model's other kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxserve.speculative.eagle3_config import NUM_AUX, Eagle3Config

# our name -> (the checkpoint's name, transposed to [in, out])
_NAMES = {
    "fc": ("fc.weight", True),
    "input_norm": ("midlayer.input_layernorm.weight", False),
    "hidden_norm": ("midlayer.hidden_norm.weight", False),
    "q_proj": ("midlayer.self_attn.q_proj.weight", True),
    "k_proj": ("midlayer.self_attn.k_proj.weight", True),
    "v_proj": ("midlayer.self_attn.v_proj.weight", True),
    "o_proj": ("midlayer.self_attn.o_proj.weight", True),
    "post_attention_norm": ("midlayer.post_attention_layernorm.weight", False),
    "gate_proj": ("midlayer.mlp.gate_proj.weight", True),
    "up_proj": ("midlayer.mlp.up_proj.weight", True),
    "down_proj": ("midlayer.mlp.down_proj.weight", True),
    "norm": ("norm.weight", False),
    "lm_head": ("lm_head.weight", False),  # [draft_vocab, E]: contracted on its second axis
}
_OPTIONAL = {"d2t", "t2d", "embed_tokens.weight"}


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """The checkpoint's shape of each required weight (torch's [out, in] for linear layers)."""
    c = cfg.layer
    e, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        "fc": (e, NUM_AUX * cfg.target_hidden_size),
        "q_proj": (q, 2 * e),
        "k_proj": (kv, 2 * e),
        "v_proj": (kv, 2 * e),
        "o_proj": (e, q),
        "gate_proj": (c.intermediate_size, e),
        "up_proj": (c.intermediate_size, e),
        "down_proj": (e, c.intermediate_size),
        "lm_head": (cfg.draft_vocab_size, e),
    }
    norms = ("input_norm", "hidden_norm", "post_attention_norm", "norm")
    return {**shapes, **{name: (e,) for name in norms}}


def _read(directory: Path) -> dict[str, np.ndarray]:
    # Imported here: the engine imports this module, and safetensors is not on every machine it runs on
    # (the GPU machine's stack), nor needed without an EAGLE-3 head.
    from checkpoints.hf import iter_tensors, weight_files

    tensors = {}
    for file in weight_files(directory):
        for name, array in iter_tensors(file):
            tensors[name.removeprefix("model.")] = array
    return tensors


def draft_targets(cfg: Eagle3Config, d2t: np.ndarray | None, where: str) -> np.ndarray:
    """i32 [draft_vocab]: the target id of each draft id (d + d2t[d]); the identity without d2t."""
    vocab, draft = cfg.layer.vocab_size, cfg.draft_vocab_size
    if d2t is None:
        if draft != vocab:
            raise ValueError(f"{where}: no d2t, and draft_vocab_size {draft} is not the target's {vocab}")
        return np.arange(vocab, dtype=np.int32)
    if d2t.shape != (draft,):
        raise ValueError(f"{where}: d2t has shape {d2t.shape}, expected ({draft},)")
    targets = np.arange(draft, dtype=np.int64) + d2t.astype(np.int64)
    if targets.min() < 0 or targets.max() >= vocab or len(np.unique(targets)) != draft:
        raise ValueError(f"{where}: d2t maps draft ids outside the target's {vocab} tokens or onto one twice")
    return targets.astype(np.int32)


def load_eagle3_weights(directory: str | Path, cfg: Eagle3Config) -> dict[str, np.ndarray]:
    """The head's parameters (f32, kernels [in, out]; `targets`: `draft_targets`; `embedding` only when the
    checkpoint has its own). ValueError naming a weight missing, misshapen or unknown."""
    directory = Path(directory).expanduser()
    where = f"EAGLE-3 head {str(directory)!r}"
    tensors = _read(directory)
    known = {name for name, _ in _NAMES.values()} | _OPTIONAL
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ValueError(f"{where}: unexpected weights {unknown[:5]}")
    params: dict[str, np.ndarray] = {}
    for ours, shape in expected_shapes(cfg).items():
        name, transposed = _NAMES[ours]
        if name not in tensors:
            raise ValueError(f"{where}: missing weight {name!r} (shape {list(shape)})")
        array = np.asarray(tensors[name], np.float32)
        if array.shape != shape:
            raise ValueError(f"{where}: weight {name!r} has shape {list(array.shape)}, expected {list(shape)}")
        params[ours] = array.T.copy() if transposed else array
    params["targets"] = draft_targets(cfg, tensors.get("d2t"), where)
    vocab, e = cfg.layer.vocab_size, cfg.layer.hidden_size
    if "t2d" in tensors and tensors["t2d"].shape != (vocab,):
        raise ValueError(f"{where}: t2d has shape {tensors['t2d'].shape}, expected ({vocab},)")
    if "embed_tokens.weight" in tensors:
        embedding = np.asarray(tensors["embed_tokens.weight"], np.float32)
        if embedding.shape != (vocab, e):
            raise ValueError(f"{where}: embed_tokens.weight has shape {list(embedding.shape)}, expected {[vocab, e]}")
        params["embedding"] = embedding
    return params
