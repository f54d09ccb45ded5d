"""Iteration-level scheduler with chunked prefill, preemption and three queue policies.

Each `schedule()` builds one step under a token budget (`max_num_batched_tokens`) and a
sequence cap (`max_num_seqs`):

1. every running decode gets one token; when the KV pool is full, the lowest-priority, latest
   running request is preempted (recompute: its blocks are freed and it re-enters the waiting
   queue with its tokens; swap: its blocks move to the host tier) until the rest fit;
2. swapped-out requests come back when their blocks fit again;
3. prompt chunks: prefills already under way continue first, capped at half the budget while
   a waiting prompt could start in the other half, so that one long prompt cannot hold back
   short ones (nor leave half a step idle when no waiting prompt could use it), then waiting requests
   are admitted in policy order (FCFS, priority, or longest cached prefix first), with their
   cached prefix taken from the radix cache. At most `max_num_partial_prefills` prompts are
   chunked at once; a request whose next block is being computed by another request in this
   very step waits one step and then hits the cache instead of computing it twice. A chunk stops
   before an image past the step's encoder budget (`max_num_encoder_images`: `encoder_budget.py`).

With a `Proposer` (speculative decoding), the decodes scheduled are offered to it for drafts, and each it
drafts for gets KV slots for its draft's tokens besides, if the pool has them (drafts never preempt anyone);
the KV slots of rejected drafts are released when the step is read (`accept_tokens`).
How drafts are made, and when, is the proposer's alone.

With multi-step decode, the `DecodeLoop` (`jaxserve.scheduler.multi_step`) says how many steps
each decode may run in one device loop; each gets KV slots for that many tokens (one step when they
do not fit), and a decode that stops early releases the rest when the step is read.

No JAX here: the scheduler is host-side bookkeeping on the hot path.
"""

from __future__ import annotations

import logging
from collections import deque
from operator import attrgetter
from typing import TYPE_CHECKING

from jaxserve.kv import KVCacheManager, LoadStart
from jaxserve.outputs import FinishReason
from jaxserve.request import Request, RequestStatus
from jaxserve.resolved_config import ResolvedConfig
from jaxserve.scheduler.blocks_in_flight import BlocksInFlight
from jaxserve.scheduler.encoder_budget import EncodedImages, EncoderBudget
from jaxserve.scheduler.multi_step import DecodeLoop, build_decode_loop
from jaxserve.scheduler.output import ScheduledChunk, SchedulerOutput
from jaxserve.scheduler.policy import waiting_in_policy_order

if TYPE_CHECKING:
    from jaxserve.lora.manager import LoraManager
    from jaxserve.speculative.proposer import Proposer

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: ResolvedConfig,
        kv: KVCacheManager,
        adapters: LoraManager | None = None,
        proposer: Proposer | None = None,
        decode_loop: DecodeLoop | None = None,
        encoded_images: EncodedImages = frozenset(),  # the encoder cache: its images cost no encoder budget
    ):
        self.config = config
        self.kv = kv
        self.adapters = adapters  # LoRA: a request is admitted once its adapter holds a LoRA slot
        self.proposer = proposer  # speculative decoding: drafts to verify (None: off)
        # Multi-step decode: each decode's steps in one device loop (the config's when not given).
        self.decode_loop = decode_loop if decode_loop is not None else build_decode_loop(config)
        self._encoder = EncoderBudget(config.max_num_encoder_images, encoded_images, config.enable_chunked_prefill)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.num_preemptions = 0
        # Smaller = more important. FCFS ignores the priority field.
        self._priority_key = (
            attrgetter("priority", "arrival_time")
            if config.scheduling_policy == "priority"
            else attrgetter("arrival_time")
        )

    # ----- queue management -----------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a new request; its content keys are seeded as the KV manager's (disk tier's) are."""
        chain = self.kv.new_chain()
        req.block_keys = chain if req.adapter is None else chain.salted(req.adapter.weights.digest)
        self.waiting.append(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Remove a request from whatever queue holds it and release its blocks."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.SWAPPED:
            self.swapped.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.kv is not None:
            self.kv.free(req.kv)
        self._release_adapter(req)
        if self.proposer is not None:  # what it keeps for the request (a draft model's KV) goes too
            self.proposer.release(req)
        self.kv.loads.cancel(req)
        req.finish(reason)

    def _release_adapter(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.adapters.release(req.lora_slot)
            req.lora_slot = -1

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ----- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step. A constrained decode whose last token is still in flight runs in it too:
        the engine reads the step in flight before this one's grammar masks are written
        (`LLMEngine._launch`)."""
        out = SchedulerOutput()
        self.kv.loads.poll()
        budget = self.config.max_num_batched_tokens
        self._encoder.digests.clear()  # the images this step encodes: none yet
        budget -= self._schedule_decodes(out)
        self._schedule_swap_ins(out)
        self._schedule_prefills(out, budget)
        out.copy_stages = self.kv.take_copies()
        if out.is_empty and self.running and not any(self._length_capped(r) or r.awaits_token for r in self.running):
            # Every running request is a prefill that cannot grow: recompute the least important
            # one later so the others can make progress instead of waiting for each other forever.
            # (Requests done by length free their blocks once their last step's output is read;
            # constrained ones waiting for a token in flight run again once it is read.)
            self._preempt(self._pick_victim(), out, mode="recompute")
            return self.schedule()
        return out

    def _length_capped(self, req: Request) -> bool:
        return req.ends_by_length(len(req.output_token_ids), self.config.max_model_len)

    def _schedule_decodes(self, out: SchedulerOutput) -> int:
        # A request whose last token (maybe still in flight) ends it by length needs no step.
        decoding = [r for r in self.running if not r.is_prefilling and not self._length_capped(r)]
        drafting = self.proposer is not None and self.proposer.may_propose(len(self.running))
        steps_of = self.decode_loop.steps_of(decoding, lambda: not drafting and self._decodes_only())
        for req in sorted(decoding, key=self._priority_key):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted to make room for a more important one
            num_steps = steps_of(req)
            if num_steps > 1 and not self.kv.allocate_kv_slots(req.kv, num_steps):
                num_steps = 1  # no room for the loop's KV slots: one step
            while num_steps == 1 and not self.kv.allocate_kv_slots(req.kv, 1):
                victim = self._pick_victim()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.decodes.append(self._chunk(req, 1, num_steps=num_steps))
        # Drafts only for the decodes scheduled (none for a preempted one), each verified if the pool has
        # the KV slots of its draft tokens besides (else a plain decode): drafts never preempt anyone.
        scheduled = [c.request for c in out.decodes] if drafting else []
        drafts = (self.proposer.propose(scheduled, len(self.running)) if scheduled else None) or {}
        for i, req in enumerate(scheduled):
            if drafts.get(req) and self.kv.allocate_kv_slots(req.kv, len(drafts[req])):
                out.decodes[i] = self._chunk(req, 1, drafts[req])  # its table grew
                out.decodes[i].draft_probs = self.proposer.draft_probs(req)
        if self.proposer is not None:
            self.proposer.on_scheduled(any(r in drafts for r in scheduled), drafted=out.is_speculative)
        return sum(1 + len(c.draft) for c in out.decodes)

    def _decodes_only(self) -> bool:
        """Nothing but decodes can run this step: no prompt waits or is being chunked, nothing is
        swapped out or loading."""
        return (
            not self.waiting
            and not self.swapped
            and not any(r.is_prefilling for r in self.running)
            and not self.kv.loads.pending
        )

    def _schedule_swap_ins(self, out: SchedulerOutput) -> None:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            req = min(self.swapped, key=self._priority_key)
            if not self.kv.swap_in(req.kv):
                return
            self.swapped.remove(req)
            req.swapped_in()
            self.running.append(req)

    def _schedule_prefills(self, out: SchedulerOutput, budget: int) -> None:
        cfg = self.config
        in_flight = BlocksInFlight(cfg.block_size)  # prompt blocks this step's prefills compute
        partial = [r for r in self.running if r.is_prefilling and not r.awaits_token]
        for req in partial:
            if budget <= 0 or len(out.prefills) >= cfg.max_prefill_seqs:
                break
            others = self._others_could_start(budget, self._num_partial(out), len(out.prefills) + 1)
            budget -= self._schedule_chunk(req, self._partial_chunk_limit(budget, others), out, in_flight)
        num_partial = self._num_partial(out)
        lora_slot_wait = False  # a request waits for a LoRA slot
        for req in waiting_in_policy_order(self.waiting, self.config.scheduling_policy, self._priority_key, self.kv):
            if budget <= 0 or len(out.prefills) >= cfg.max_prefill_seqs:
                break
            if len(self.running) >= cfg.max_num_seqs:
                break
            if req.awaits_token:
                continue  # preempted with its last token in flight
            if self.kv.loads.is_loading(req):
                continue  # its prefix is being read from disk; others go meanwhile
            cacheable = req.copy_cache_tokens(req.num_cacheable_tokens)
            hit = self.kv.match_prefix(cacheable, req.block_keys)
            if hit.num_disk_tokens >= max(cfg.kv_disk_min_load_tokens, 1):
                if self.kv.loads.start(req, hit) is not LoadStart.NONE:
                    continue  # loading (or waiting for room to load): admitted once on the host
                hit = self.kv.match_prefix(cacheable, req.block_keys)
            remaining = req.num_tokens - hit.num_tokens
            if remaining > budget and num_partial >= cfg.max_num_partial_prefills:
                continue  # a long prompt waits; shorter ones behind it may go
            if self._block_in_flight(req, hit.num_tokens, in_flight):
                continue  # it will find that block in the cache next step
            n = min(remaining, budget)
            if n < remaining:
                if not cfg.enable_chunked_prefill:
                    continue
                others = self._others_could_start(budget, num_partial + 1, len(out.prefills) + 1, besides=req)
                n = req.prefill_chunk(hit.num_tokens, self._partial_chunk_limit(budget, others))
            n = self._encoder.cut(req.images, hit.num_tokens, n, may_split=num_partial < cfg.max_num_partial_prefills)
            if n == 0:
                continue  # it would split an image, or reach one past the encoder budget: it waits for room
            n = self._to_snapshot(req, hit.num_tokens, n)
            if req.adapter is not None:
                # Behind a request waiting for a LoRA slot, adapter requests wait too (even of resident
                # adapters), so the pins drain and it gets its LoRA slot: no adapter starves.
                lora_slot = None if lora_slot_wait else self.adapters.acquire(req.adapter)
                if lora_slot is None:
                    lora_slot_wait = True
                    continue  # every LoRA slot is pinned by other adapters' requests: it waits
                req.lora_slot = lora_slot
            kv = self.kv.admit(hit, n, load_key=req)
            if kv is None:
                self._release_adapter(req)
                break  # the pool is full: admit nothing more this step
            req.start_running(kv, hit.num_tokens)
            used = self._add_prefill(req, n, out, in_flight)
            self.waiting.remove(req)
            self.running.append(req)
            budget -= used
            if used < remaining:
                num_partial += 1

    def _num_partial(self, out: SchedulerOutput) -> int:
        """Running prompts still being prefilled that no chunk of `out` completes."""
        completed = {c.request for c in out.prefills if c.sample}
        return sum(1 for r in self.running if r.is_prefilling and r not in completed)

    def _partial_chunk_limit(self, budget: int, others_could_start: bool) -> int:
        """Tokens a prefill that will not finish this step may take: half the budget while
        other prompts could start in the other half, so one long prompt never holds back the
        short ones behind it (and never leaves half a step idle when none could start)."""
        return budget // 2 if others_could_start and budget > self.config.block_size else budget

    def _others_could_start(
        self, budget: int, num_partial: int, num_prefills: int, besides: Request | None = None
    ) -> bool:
        """Whether a waiting prompt (other than `besides`) could join this step in the half of
        `budget` a capped chunk leaves, with `num_partial` prompts chunking and `num_prefills`
        chunks in the step: as a chunk of its own while fewer than `max_num_partial_prefills`
        prompts are chunking, else only if its whole prompt fits (its cached prefix, unknown
        before it is matched, is not counted)."""
        cfg = self.config
        if num_prefills >= cfg.max_prefill_seqs or len(self.running) + (besides is not None) >= cfg.max_num_seqs:
            return False
        rest = budget - budget // 2
        return any(
            r is not besides
            and not r.awaits_token
            and (num_partial < cfg.max_num_partial_prefills or r.num_tokens <= rest)
            for r in self.waiting
        )

    def _schedule_chunk(self, req: Request, budget: int, out: SchedulerOutput, in_flight: BlocksInFlight) -> int:
        """Continue a running prefill with up to `budget` tokens; return how many (0: no room)."""
        n = req.prefill_chunk(req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
        n = self._encoder.cut(req.images, req.num_computed_tokens, n)
        n = self._to_snapshot(req, req.num_computed_tokens, n)
        if n == 0 or not self.kv.allocate_kv_slots(req.kv, n):
            return 0
        return self._add_prefill(req, n, out, in_flight)

    def _to_snapshot(self, req: Request, start: int, n: int) -> int:
        """A hybrid's prompt chunk ends at the prompt's last block boundary if it would cross it: its state
        there is kept for prefix hits (`on_step_launched`, jaxserve/kv/state_snapshots.py)."""
        boundary = req.num_prompt_tokens // self.config.block_size * self.config.block_size
        cut = self.kv.snapshots.enabled and self.config.enable_chunked_prefill and start < boundary < start + n
        return boundary - start if cut else n

    def _add_prefill(self, req: Request, n: int, out: SchedulerOutput, in_flight: BlocksInFlight) -> int:
        out.prefills.append(self._chunk(req, n))
        self._encoder.take(req.images, req.num_computed_tokens, n)
        if self.config.enable_prefix_caching:
            bs = self.config.block_size
            first, last = req.num_computed_tokens // bs, min(req.num_computed_tokens + n, req.num_prompt_tokens) // bs
            if last > first:
                in_flight.add(req, first, last)
        return n

    def _block_in_flight(self, req: Request, start: int, in_flight: BlocksInFlight) -> bool:
        """Whether the prompt's block at `start` (a block boundary) is being computed by another
        request's prefill in this step: the same content key (`Request.block_keys`)."""
        i = start // self.config.block_size
        return bool(in_flight) and (i + 1) * self.config.block_size <= req.num_prompt_tokens and in_flight.holds(req, i)

    def _chunk(self, req: Request, n: int, draft: list[int] | None = None, num_steps: int = 1) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(
            req,
            start,
            n,
            req.kv.block_table,
            start + n == req.num_tokens,
            draft=[] if draft is None else draft,
            num_steps=num_steps,
            table_version=req.kv.version,
        )

    # ----- policies and preemption ----------------------------------------------------------

    def _pick_victim(self) -> Request:
        growing = [r for r in self.running if not self._length_capped(r)]
        return max(growing or self.running, key=self._priority_key)

    def _preempt(self, req: Request, out: SchedulerOutput, mode: str | None = None) -> None:
        self.running.remove(req)
        self.num_preemptions += 1
        if self.proposer is not None:  # a draft model's KV is recomputed when the request runs again
            self.proposer.release(req)
        if (mode or self.config.preemption_mode) == "swap" and not req.is_prefilling and self.kv.swap_out(req.kv):
            req.preempt(swapped=True)
            self.swapped.append(req)
            logger.info("preempted %s by swap", req.request_id)
            return
        self.kv.free(req.kv)
        self._release_adapter(req)
        req.preempt(swapped=False)
        self.waiting.appendleft(req)
        logger.info("preempted %s by recompute (%d tokens)", req.request_id, req.num_tokens)

    # ----- after the launch -----------------------------------------------------------------

    def on_step_launched(self, out: SchedulerOutput) -> None:
        """The step is on the device: its tokens count as computed, each sampling chunk gets a
        PLACEHOLDER for its new token (`chunk.output_index` says where), and full blocks whose
        tokens are all known join the prefix cache (the device writes them before any later
        step reads them)."""
        bs = self.config.block_size
        for chunk in out.prefills + out.decodes:
            req = chunk.request
            end = chunk.start + chunk.num_new_tokens
            index = req.launched(end, chunk.sample)
            if index is not None:
                chunk.output_index = index
            self.cache_known_blocks(req)
            if req.status is RequestStatus.RUNNING:  # later steps' queries start at its computed tokens
                self.kv.window.slide(req.kv, req.num_computed_tokens)
            if self.kv.snapshots.enabled and end == req.num_prompt_tokens // bs * bs > chunk.start:
                self.kv.snapshots.save(req.kv, req.prompt_token_ids, end // bs)

    def accept_tokens(self, req: Request, num_extra: int) -> None:
        """A verified or multi-step decode was read and kept `num_extra` tokens beyond its first
        (accepted drafts, or the loop's later tokens): their K/V are valid (the request's next
        token follows them), the KV slots reserved past them are released."""
        req.launched(req.num_computed_tokens + num_extra, samples=False)
        self.kv.release_kv_slots(req.kv, req.num_computed_tokens)

    def on_token_read(self, req: Request, index: int) -> None:
        """Output tokens from `index` on were read from the device and the request goes on: cache
        the blocks that their reading completed, if any (a block is cached once all its tokens
        are computed and known, `cache_known_blocks`)."""
        bs = self.config.block_size
        if req.num_prompt_tokens + index < req.num_computed_tokens - req.num_computed_tokens % bs:
            self.cache_known_blocks(req)

    def cache_known_blocks(self, req: Request) -> None:
        """Insert the request's computed full blocks into the prefix cache, up to its first
        token still in flight (called again when that token is read). With a sliding window, only
        its prompt's: a cached path stays locked while the request holds a block of it, so caching
        the output would keep every block of a long decode (jaxserve/kv/window.py)."""
        if not self.config.enable_prefix_caching or req.status is not RequestStatus.RUNNING:
            return
        bs, cached = self.config.block_size, req.kv.cached_blocks
        if req.num_computed_tokens // bs > cached and req.kv.may_cache_more:  # a block filled since the last insert
            n = min(req.num_computed_tokens, req.num_known_tokens)
            if self.kv.window.enabled:
                n = min(n, req.num_prompt_tokens)
            if n // bs > cached:
                self.kv.cache_full_blocks(req.kv, req.copy_cache_tokens(n))
