"""Conversions between the engine's types and the worker service's messages, for both ends."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from jaxserve.engine_snapshot import EngineSnapshot, KVUsage, ReplicaLoad, TierStats
from jaxserve.outputs import Delta, TokenLogprob, Usage
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.spec import GuidedDecoding
from server.cluster.worker import worker_pb2 as pb

PROTOCOL_VERSION = 1


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
