"""MTP speculation: the target's own multi-token prediction layer (DeepSeek-V3's, `mtp_model`) drafts k tokens
per decode as a chain.

`MtpProposer` is the draft-model proposer (`DraftModelProposer`: when it drafts, its own paged KV cache in
`DraftKV` blocks freed on `release`, catch-up in chunks, greedy or sampled drafts with q for rejection
sampling) over another model: the MTP layer, whose row at position p takes the token t_{p+1} (`offset` 1) and
the target's last hidden state h_p. The engine hands it the hidden states each target step computed
(`take_hidden`: the runner reads them off the steps only for a proposer that `wants_hidden`); they wait per
request (`PendingHidden`) until the layer's catch-up computes their positions, which happens when the request
is next drafted for (the engine reads every step before one that may draft, so they are all there), or
earlier, once a token bucket's worth waits (a batch too large to draft for). A position the target did not
compute (a prefix-cache hit) is caught up with a zero hidden state: its latent then holds its token alone,
which can only lower acceptance, never change the output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxserve.model.kv_cache import KVCache
from jaxserve.request import Request, RequestStatus
from jaxserve.resolved_config import ResolvedConfig
from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.draft_model import DraftDevice, DraftModelProposer, DraftShapes
from jaxserve.speculative.draft_programs import DraftPrograms
from jaxserve.speculative.hidden_rows import HiddenRows, PendingHidden
from jaxserve.speculative.mtp_model import mtp_layer_stack, mtp_params
from jaxserve.speculative.mtp_programs import MtpInputs, mtp_chain
from sharding.rules import cache_sharding

logger = logging.getLogger(__name__)


class MtpProposer(DraftModelProposer):
    offset = 1
    wants_hidden = True

    def __init__(
        self,
        spec: SpeculativeConfig,
        max_model_len: int,
        device: DraftDevice,
        shapes: DraftShapes,
        hidden_size: int,
        chain: Callable[..., Any] = mtp_chain,
    ) -> None:
        """`hidden_size`: the width of the target's rows it takes; `chain`: its device program (`hidden_chain` of
        its head's forward: the MTP layer's, or an EAGLE-3 head's)."""
        k = spec.num_speculative_tokens
        example = MtpInputs.example(hidden_size)
        programs = DraftPrograms(device.model, device.block_size, k, shapes.variants(), chain, example)
        super().__init__(spec, max_model_len, device, shapes, programs)
        self.hidden_size = hidden_size
        self.hidden: dict[Request, PendingHidden] = {}  # the target's states the layer has not computed yet

    def take_hidden(self, rows: Sequence[HiddenRows]) -> None:
        """Keep a step's hidden states until the catch-up computes their positions; those of a request that
        left the running batch since the step was launched (finished or preempted: released) are dropped.
        Requests whose waiting states reach the largest token bucket are caught up now (`_catch_up_waiting`)."""
        for r in rows:
            if r.request.status is RequestStatus.RUNNING:
                self.hidden.setdefault(r.request, PendingHidden(self.hidden_size)).add(r.position, r.rows)
        self._catch_up_waiting()

    def _catch_up_waiting(self) -> None:
        """Catch up the requests with a token bucket's worth of states waiting, over the positions whose next
        token is known: while the batch is too large to draft for, steps keep coming without a proposal, and
        this bounds what waits on the host to about a bucket's rows per request (the chain's drafts are not
        used; its blocks are reserved as a proposal's are, and a request the pool has no room for waits)."""
        budget = min(tokens[-1] for tokens in self.shapes.tokens.values())
        k, chunk = self.spec.num_speculative_tokens, []
        for req, pending in self.hidden.items():
            if pending.num_rows < budget or len(chunk) == self.shapes.seqs[-1]:
                continue
            start = self.kv.sequences[req].num_computed if req in self.kv.sequences else 0
            n = min(req.num_known_tokens - 1 - start, budget)
            seq = self.kv.reserve(req, start + n + k - 1) if n > 0 else None
            if seq is not None:
                chunk.append((req, seq, n))
                budget -= n
        if chunk:
            self._run(chunk)

    def release(self, request: Request) -> None:
        super().release(request)
        self.hidden.pop(request, None)

    def _run(self, chunk: list[tuple[Request, Any, int]], num_drafts: int = 1) -> tuple[np.ndarray, Any]:
        out = super()._run(chunk, num_drafts)
        for req, seq, _ in chunk:
            if req in self.hidden:
                self.hidden[req].drop_before(seq.num_computed)
        return out

    def _inputs(self, chunk: list[tuple[Request, Any, int]], num_drafts: int) -> MtpInputs:
        """The draft model's rows (tokens shifted by `offset`) with each row's hidden state h_p."""
        x = super()._inputs(chunk, num_drafts)
        hidden = np.zeros((len(x.tokens), self.hidden_size), np.float32)
        row = 0
        for req, seq, n in chunk:
            pending = self.hidden.get(req)
            if pending is not None:
                hidden[row : row + n] = pending.take(seq.num_computed, n)
            row += n
        return MtpInputs(x, hidden)


def build_mtp_proposer(spec: SpeculativeConfig, ec: ResolvedConfig, runner: Any) -> MtpProposer:
    """The MTP proposer of the target `runner` serves (`ModelRunner`; its checkpoint's `mtp` parameters and the
    embedding and head they share, which the runner already holds, and its attention and expert backends): a
    cache of one layer (latent, or K/V heads) with as many blocks as the target's (each MTP position is a
    target position). The target and settings were checked when the config was resolved
    (`mtp_target.check_mtp_target`)."""
    model = runner.model
    stack = mtp_layer_stack(runner.config, model.compute_dtype, model.dtype, model.backend, model.experts)
    config = stack.config
    cache = jax.jit(
        lambda: KVCache.zeros(config, ec.num_blocks, ec.block_size, runner.kv_dtype),
        out_shardings=cache_sharding(runner.mesh, latent=config.is_mla),
    )()
    block_bytes = KVCache.bytes_per_block(config, ec.block_size, runner.kv_dtype)
    logger.info("MTP cache: %d blocks (%.1f MB)", ec.num_blocks, ec.num_blocks * block_bytes / 1e6)
    params = mtp_params(runner.params)
    layers = jax.tree.leaves(params["mtp"]["layer"])[0].shape[0]
    if layers > 1:
        logger.info("the checkpoint has %d MTP layers: drafting with the first", layers)
    device = DraftDevice(stack, params, cache, ec.num_blocks, ec.block_size)
    shapes = DraftShapes.for_config(
        ec.verify_batch_buckets, spec.num_speculative_tokens, ec.prefill_token_buckets, ec.block_table_buckets
    )
    return MtpProposer(spec, ec.max_model_len, device, shapes, runner.config.hidden_size)
