"""An EAGLE-3 head's `config.json` (the layout vLLM's `llama_eagle3` and SpecForge write: architectures
["LlamaForCausalLMEagle3"] or ["Eagle3LlamaForCausalLM"], a Llama config of one layer, `draft_vocab_size`, and
optionally `eagle_config.eagle_aux_hidden_state_layer_ids`), and which targets and settings `"method":
"eagle3"` serves (checked when the config is resolved, before anything is loaded: `check_eagle3_target`).

The aux layers use vLLM's numbering: id i is the residual stream entering the target's layer i (0: the
embedding), so ids lie in [0, L); without them in the config, vLLM's default (2, L // 2, L - 3)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoints.architectures.hf_config import common_fields
from checkpoints.architectures.layer_groups import is_hybrid
from checkpoints.config import ModelConfig

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX = 3  # fc takes the concatenation of three target states


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The head's decoder layer (a Llama `ModelConfig` of one layer over the target's vocabulary), its draft
    vocabulary, the target layers whose input states it reads, and where its first layer's residual starts
    (`norm_before_residual`: the normed hidden state, else the state itself, vLLM's default)."""

    layer: ModelConfig
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool
    target_hidden_size: int


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default aux layers of a target of `num_layers` layers."""
    return (2, num_layers // 2, num_layers - 3)


def _aux_layers(hf: dict[str, Any], num_layers: int, where: str) -> tuple[int, ...]:
    eagle = hf.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or hf.get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(i) for i in ids) if ids else default_aux_layers(num_layers)
    if len(layers) != NUM_AUX or not all(0 <= i < num_layers for i in layers):
        origin = (
            "eagle_aux_hidden_state_layer_ids"
            if ids
            else f"the default aux layers (2, L // 2, L - 3), L = {num_layers}"
        )
        raise ValueError(
            f"{where}: {origin} = {list(layers)}: an EAGLE-3 head reads {NUM_AUX} target layers, each in "
            f"[0, {num_layers}) (the target's layer count); set eagle_config.eagle_aux_hidden_state_layer_ids"
        )
    return layers


def read_eagle3_config(path: str | Path, target: ModelConfig) -> Eagle3Config:
    """The head at `path` (a Hugging Face directory) for `target`; ValueError naming what does not fit."""
    directory = Path(path).expanduser()
    file = directory / "config.json"
    if not file.is_file():
        raise ValueError(f'speculative method "eagle3" needs "model": a directory with config.json; {file} not found')
    hf = json.loads(file.read_text(encoding="utf-8"))
    where = f"EAGLE-3 head {str(directory)!r}"
    arch = hf.get("architectures") or []
    if not set(arch) & set(EAGLE3_ARCHITECTURES):
        raise ValueError(f"{where}: architectures {arch} is not an EAGLE-3 head ({' or '.join(EAGLE3_ARCHITECTURES)})")
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{where}: num_hidden_layers = {hf['num_hidden_layers']}; heads of one layer are served")
    if hf.get("eagle_config", {}).get("use_aux_hidden_state") is False:
        raise ValueError(f"{where}: use_aux_hidden_state = false (an EAGLE-1 style head) is not served")
    fields = common_fields({**hf, "vocab_size": target.vocab_size}, "llama")
    layer = ModelConfig(**{**fields, "num_layers": 1, "bos_token_id": None, "eos_token_ids": ()})
    if layer.attention_bias or hf.get("mlp_bias"):
        raise ValueError(f"{where}: attention_bias / mlp_bias heads are not served (no biases are loaded)")
    vocab = int(hf.get("vocab_size", target.vocab_size))
    target_hidden = int(hf.get("target_hidden_size") or layer.hidden_size)
    for name, theirs, ours in (
        ("vocab_size", vocab, target.vocab_size),
        ("hidden_size", layer.hidden_size, target.hidden_size),
        ("target_hidden_size", target_hidden, target.hidden_size),
    ):
        if theirs != ours:
            raise ValueError(f"{where}: {name} = {theirs}, the target's is {ours}: the head must match its target")
    draft_vocab = int(hf.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise ValueError(f"{where}: draft_vocab_size = {draft_vocab} must be in [1, {vocab}]")
    aux = _aux_layers(hf, target.num_layers, where)
    return Eagle3Config(layer, draft_vocab, aux, bool(hf.get("norm_before_residual", False)), target_hidden)


def check_eagle3_target(config: EngineConfig, model: ModelConfig) -> tuple[int, ...]:
    """The target layers whose input states the configured EAGLE-3 head reads (() without one); ValueError
    naming the setting or the mismatch refused."""
    spec = config.speculative_config
    if spec is None or spec.method != "eagle3":
        return ()
    if model.is_mla or is_hybrid(model):
        kind = "multi-head latent attention" if model.is_mla else "a Gated DeltaNet hybrid"
        raise ValueError(f'speculative method "eagle3" is not served for {model.architecture} ({kind}) yet')
    refused = [
        name
        for name, on in (
            (f"tensor_parallel_size={config.tensor_parallel_size}", config.tensor_parallel_size > 1),
            (f"pipeline_parallel_size={config.pipeline_parallel_size}", config.pipeline_parallel_size > 1),
            (f"data_parallel_size={config.data_parallel_size}", config.data_parallel_size > 1),
            (f"quantization={config.quantization}", config.quantization != "none"),
            (f"num_scheduler_steps={config.num_scheduler_steps}", config.num_scheduler_steps > 1),
            ("unroll_layers=True", config.unroll_layers),
        )
        if on
    ]
    if refused:
        raise ValueError(f'speculative method "eagle3" is not served with {", ".join(refused)} yet')
    return read_eagle3_config(spec.model, model).aux_layers
