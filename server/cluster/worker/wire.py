"""Conversions between the engine's types and the worker service's messages, for both ends."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxserve.engine_snapshot import EngineSnapshot, KVUsage, ReplicaLoad, TierStats
from jaxserve.image_prompt import PromptImage, salt_rows
from jaxserve.images import ImageInput
from jaxserve.outputs import Delta, TokenLogprob, Usage
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.spec import GuidedDecoding
from server.cluster.worker import worker_pb2 as pb

PROTOCOL_VERSION = 2  # 2: prompts carry their images (GenerateRequest.images)


def params_to_json(params: SamplingParams) -> str:
    fields = dataclasses.asdict(params)
    if params.guided is not None:  # the constraint travels as what it was built from
        fields["guided"] = {"kind": params.guided.kind, "value": params.guided.value}
    return json.dumps(fields)


def params_from_json(text: str) -> SamplingParams:
    """The request's SamplingParams; ValueError for JSON that is not one (validated as always)."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"sampling_params_json does not parse: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError("sampling_params_json must be a JSON object")
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown sampling parameters: {', '.join(unknown)}")
    bias = fields.get("logit_bias")
    if isinstance(bias, dict):  # JSON keys are strings
        try:
            fields["logit_bias"] = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids") from None
    guided = fields.get("guided")
    if guided is not None:
        if not isinstance(guided, dict) or set(guided) != {"kind", "value"}:
            raise ValueError("guided must be an object with kind and value")
        fields["guided"] = GuidedDecoding(**guided)
    try:
        return SamplingParams(**fields)
    except TypeError as e:
        raise ValueError(str(e)) from None


def images_to_messages(images: Sequence[PromptImage]) -> list[pb.PromptImage]:
    """A prompt's images as the worker protocol carries them: their rows, digests and pixels."""
    return [
        pb.PromptImage(
            start=row.start,
            length=row.length,
            bidirectional=row.bidirectional,
            digest=row.image.digest,
            pixels=np.asarray(row.image.pixels, "<f4").tobytes(),
            size=row.image.pixels.shape[-1],
        )
        for row in images
    ]


def images_from_messages(
    messages: Sequence[pb.PromptImage], ids: Sequence[int], vision: Any
) -> tuple[PromptImage, ...]:
    """A request's images for a model with vision tower `vision` (its config; None: none), checked
    against it and the prompt `ids`: each a tile of the tower's size whose digest is its pixels', its
    rows in order over the image token (ValueError naming what does not fit)."""
    if messages and vision is None:
        raise ValueError("this model takes no images (it has no vision tower)")
    images: list[PromptImage] = []
    end = 0
    for i, m in enumerate(messages):
        size = vision.image_size
        if m.size != size or len(m.pixels) != 3 * size * size * 4:
            raise ValueError(f"image {i}: its pixels are not [3, {size}, {size}] float32")
        rows = ids[m.start : m.start + m.length]
        tokens = len(rows) == m.length == vision.mm_tokens_per_image and all(t == vision.image_token_id for t in rows)
        if m.start < end or not tokens:
            raise ValueError(f"image {i}: its rows [{m.start}, {m.start + m.length}) are not its image tokens")
        if m.bidirectional != vision.bidirectional_images:
            raise ValueError(f"image {i}: bidirectional must be {vision.bidirectional_images} for this model")
        image = ImageInput.of(np.frombuffer(m.pixels, "<f4").reshape(3, size, size))
        if image.digest != m.digest:
            raise ValueError(f"image {i}: its digest is not its pixels'")
        images.append(PromptImage(m.start, m.length, image, m.bidirectional))
        end = m.start + m.length
    return tuple(images)


def cache_ids_of(prompt_ids: Sequence[int], images: Sequence[pb.PromptImage]) -> list[int]:
    """A request's prompt as prefix caches key it: its `images`' rows salted by their digests."""
    ids = list(prompt_ids)
    for m in images:
        salt_rows(ids, m.start, m.start + m.length, m.digest)
    return ids


def delta_to_message(delta: Delta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        token_ids=delta.token_ids, finish_reason=delta.finish_reason or "", error=delta.error or ""
    )
    for lp in delta.logprobs or ():
        msg.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_ids=[i for i, _ in lp.top],
            top_logprobs=[p for _, p in lp.top],
        )
    if delta.embedding is not None:
        msg.embedding = np.asarray(delta.embedding, "<f4").tobytes()
    if delta.usage is not None:
        u = delta.usage
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens
            )
        )
    return msg


def logprobs_from_message(msg: pb.GenerateResponse) -> list[TokenLogprob]:
    return [TokenLogprob(lp.token_id, lp.logprob, list(zip(lp.top_ids, lp.top_logprobs))) for lp in msg.logprobs]


def embedding_from_message(msg: pb.GenerateResponse) -> np.ndarray | None:
    """A pooling request's vector, from its last message (None on other messages)."""
    return np.frombuffer(msg.embedding, "<f4").astype(np.float32) if msg.embedding else None


def usage_from_message(msg: pb.GenerateResponse) -> Usage | None:
    if not msg.HasField("usage"):
        return None
    u = msg.usage
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def snapshot_to_json(snapshot: EngineSnapshot) -> str:
    return json.dumps(dataclasses.asdict(snapshot))


def snapshot_from_json(text: str) -> EngineSnapshot:
    fields = json.loads(text)
    fields["kv"] = KVUsage(**fields["kv"])
    fields["replicas"] = tuple(ReplicaLoad(**r) for r in fields["replicas"])
    fields["tiers"] = TierStats(**fields["tiers"])
    fields["lora_requests"] = tuple((name, count) for name, count in fields.get("lora_requests", ()))
    for name in ("expert_tokens", "expert_load", "pipeline_stage_busy_ticks"):
        fields[name] = tuple(fields[name])
    fields.pop("kv_transfer", None)  # a router's count, not a worker's
    return EngineSnapshot(**fields)
