"""Loading the draft model of `"method": "draft_model"`: with the target's loaders, flags and mesh, checked to
share the target's tokenizer, served like the target (`serve_model`) with a KV cache of its own. And the
engine's one entry to the proposers built with a model (`load_model_proposer`: the draft model's, the
target's own MTP layer's, or an EAGLE-3 head's)."""

from __future__ import annotations

import dataclasses
from typing import Any

from checkpoints.loaded import LoadedModel
from checkpoints.registry import load_model
from jaxserve.config import EngineConfig
from jaxserve.config_resolution import resolve
from jaxserve.dtype_choice import load_dtype
from jaxserve.quantization_choice import weights_quantization
from jaxserve.resolved_config import ResolvedConfig
from jaxserve.runner.model_setup import build_cache, serve_model
from jaxserve.runner.placement import checkpoint_shardings
from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.draft_model import DraftDevice, DraftModelProposer, DraftShapes
from jaxserve.speculative.eagle3_proposer import build_eagle3_proposer
from jaxserve.speculative.mtp_proposer import MtpProposer, build_mtp_proposer


def load_model_proposer(
    spec: SpeculativeConfig, config: EngineConfig, ec: ResolvedConfig, target: LoadedModel, runner: Any
) -> DraftModelProposer | MtpProposer:
    """The proposer of "draft_model" (`load_draft_proposer`), "mtp" (`build_mtp_proposer`) or "eagle3"
    (`build_eagle3_proposer`), over the target `runner` serves (`ModelRunner`)."""
    if spec.method == "mtp":
        return build_mtp_proposer(spec, ec, runner)
    if spec.method == "eagle3":
        return build_eagle3_proposer(spec, ec, runner)
    return load_draft_proposer(spec, config, ec, target, runner.mesh)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel, name: str) -> None:
    """ValueError unless the draft's token list (every token and its id) and vocabulary size are the target's:
    its drafts are token ids the target verifies."""
    theirs, ours = draft.tokenizer_bundle.tokenizer.get_vocab(), target.tokenizer_bundle.tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"the draft model {name!r} has another tokenizer than the target ({len(theirs)} tokens against "
            f"{len(ours)}; first differences (token, id): {differ}): a draft model must share the target's tokenizer"
        )
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the draft model {name!r} has {draft.config.vocab_size} vocabulary rows, the target "
            f"{target.config.vocab_size}: a draft model must have the target's vocabulary"
        )


def load_draft_proposer(
    spec: SpeculativeConfig, config: EngineConfig, ec: ResolvedConfig, target: LoadedModel, mesh: Any
) -> DraftModelProposer:
    """The draft model `spec.model` loaded like the target (`config`: the user's flags, `spec.quantization` for
    the draft's own; `ec`: the target's resolved config) onto the target runner's `mesh`, with a KV cache of as
    many blocks as the target's (each draft position is a target position, so it never needs more)."""
    asked = dataclasses.replace(config, quantization=spec.quantization or config.quantization)
    draft_config = dataclasses.replace(
        config,
        quantization=weights_quantization(asked, spec.model),  # "auto": chosen for the draft's own file
        speculative_config=None,
        enable_lora=False,
        num_blocks=ec.num_blocks,
        max_model_len=ec.max_model_len,
    )
    draft = load_model(
        spec.model,
        dtype=load_dtype(draft_config.quantization, ec.dtype),
        shardings=checkpoint_shardings(draft_config, mesh),
        gguf_blocks=draft_config.quantization == "gguf",
    )
    check_same_tokenizer(target, draft, spec.model)
    dec = resolve(draft_config, draft.config, ec.dtype)
    if dec.max_model_len < ec.max_model_len:
        raise ValueError(
            f"the draft model {spec.model!r} serves a context of {dec.max_model_len} tokens, the target "
            f"{ec.max_model_len}: lower max_model_len"
        )
    served = serve_model(draft.config, draft.params, dec, mesh)
    cache = build_cache(served.config, dec, mesh, served.kv_dtype)
    device = DraftDevice(served.model, served.params, cache, dec.num_blocks, dec.block_size)
    shapes = DraftShapes.for_config(
        ec.verify_batch_buckets, spec.num_speculative_tokens, ec.prefill_token_buckets, ec.block_table_buckets
    )
    return DraftModelProposer(spec, ec.max_model_len, device, shapes)
