"""What the engine does with an iteration's read outputs: each sampled token lands in its request
(`_update`, the one place every stop rule applies), prompt log-probabilities and pooled rows are
added, finished requests end with their final delta, and a request whose own part raises fails
alone (an ERROR delta, its blocks freed) while the others go on.

Embeddings: once the step that samples after a pooling request's last prompt token is read, the
request ends with the pooled vector in its final delta and the sampled token is dropped (its
max_tokens of 1 keeps it from another step)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

from jaxserve import faults
from jaxserve.outputs import Delta, FinishReason, SampledToken, Usage
from jaxserve.request import Request
from jaxserve.runner import StepHandle, read_pooled, read_prompt_scores
from jaxserve.runner.prepared_step import PreparedStep
from jaxserve.scheduler import Scheduler
from jaxserve.scheduler.output import ScheduledChunk, SchedulerOutput
from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.proposer import Proposer
from jaxserve.text_stream import TextStream

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepStats:
    num_steps: int = 0
    step_time: float = 0.0  # all of step(), wall clock
    model_time: float = 0.0  # host time in the runner: building and launching, then waiting to read
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    # Iterations whose output was read only after the next one was launched (async scheduling).
    overlapped_reads: int = 0
    # Iterations whose prefill chunks and decodes ran as one model step.
    mixed_steps: int = 0
    failed_requests: int = 0  # requests ended by an error in their own part of a step
    # Speculative decoding: steps that verified drafts, drafts verified, drafts accepted.
    speculative_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    num_drafts: int = 0  # verified decodes that carried a draft
    # Per draft position j (0: the first drafted token): drafts that had a token there, and those accepted.
    position_drafts: list[int] = dataclasses.field(default_factory=list)
    position_accepted: list[int] = dataclasses.field(default_factory=list)

    def count_draft(self, length: int, accepted: int) -> None:
        """A verified draft of `length` tokens, its first `accepted` accepted."""
        self.draft_tokens += length
        self.accepted_tokens += accepted
        self.num_drafts += 1
        for counts in (self.position_drafts, self.position_accepted):
            counts.extend([0] * (length - len(counts)))
        for j in range(length):
            self.position_drafts[j] += 1
            self.position_accepted[j] += j < accepted

    @classmethod
    def total(cls, stats: list[StepStats]) -> StepStats:
        """Several engines' statistics summed (the per-position counts position by position)."""

        def summed(values: list) -> Any:
            if isinstance(values[0], list):
                return [sum(v) for v in itertools.zip_longest(*values, fillvalue=0)]
            return sum(values)

        return cls(*(summed([getattr(s, f.name) for s in stats]) for f in dataclasses.fields(cls)))

    def speculative_counts(self, spec: SpeculativeConfig | None, proposer: Proposer | None) -> dict[str, Any]:
        """`EngineSnapshot`'s speculative decoding fields: the per-position counts as long as the draft."""
        k = spec.num_speculative_tokens if spec is not None else 0
        return dict(
            speculative_steps=self.speculative_steps,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            num_drafts=self.num_drafts,
            position_drafts=tuple((self.position_drafts + [0] * k)[:k]),
            position_accepted=tuple((self.position_accepted + [0] * k)[:k]),
            draft_seconds=proposer.draft_seconds if proposer is not None else 0.0,
            chosen_draft_tokens=proposer.draft_length.chosen_tokens if proposer is not None else 0,
            draft_length_steps=proposer.draft_length.decode_steps if proposer is not None else 0,
        )

    def count_launch(self, sched: SchedulerOutput, prepared: PreparedStep, model_time: float) -> None:
        """A launched iteration, and the runner's host time building and launching it."""
        self.model_time += model_time
        self.prompt_tokens_computed += sum(c.num_new_tokens for c in sched.prefills)
        self.num_steps += 1
        self.speculative_steps += sched.is_speculative
        self.mixed_steps += bool(sched.prefills) and len(prepared.parts[0]) > len(sched.prefills)


class OutputProcessor:
    """Lands read iterations in the engine's live requests (`groups`: request id -> its sequences,
    shared with the engine) through its scheduler, counting into `stats`."""

    def __init__(self, scheduler: Scheduler, groups: dict[str, list[Request]], stats: StepStats, max_model_len: int):
        self.scheduler = scheduler
        self.groups = groups
        self.stats = stats
        self.max_model_len = max_model_len

    def land(self, handle: StepHandle, results: list[tuple[ScheduledChunk, list[SampledToken]]]) -> list[Delta]:
        """Update every request a read iteration (`handle`, its tokens `results`) sampled for."""
        for req, first, scored in read_prompt_scores(handle):
            if not req.is_finished:
                req.add_prompt_logprobs(first, scored)
        for req, total, rows in read_pooled(handle):
            if not req.is_finished:
                req.pooling.add(total, rows)
        deltas = []
        finished_groups = set()
        for chunk, tokens in results:
            req = chunk.request
            if req.is_finished:  # aborted, failed or ended while its step was running
                continue
            stream = req.text
            try:
                if req.pooling is not None:  # an embedding: its prompt is pooled, its sampled token dropped
                    deltas.append(self._pooled_delta(req))
                    finished_groups.add(stream.group_id)
                    continue
                reason = self._update_all(req, stream, chunk, tokens)
                if reason is not None:
                    self.scheduler.finish(req, reason)
                    deltas.append(self.final_delta(req, reason))
                    finished_groups.add(stream.group_id)
                else:
                    self.scheduler.on_token_read(req, chunk.output_index)
                    delta = stream.take_delta(None, None, prompt_logprobs=req.prompt_logprobs)
                    if delta is not None:
                        deltas.append(delta)
            except Exception as e:  # noqa: BLE001 - one request's fault
                deltas += self.fail(req, e)
        for group_id in finished_groups:
            self.forget_if_finished(group_id)
        return deltas

    def _update_all(
        self, req: Request, stream: TextStream, chunk: ScheduledChunk, tokens: list[SampledToken]
    ) -> FinishReason | None:
        """Land a chunk's tokens in order: one, a verified decode's accepted drafts and the
        token after them, or a multi-step decode's tokens. Every stop rule applies to each;
        tokens after a stop are dropped. A request that goes on keeps the K/V of the tokens it
        kept only."""
        reason = None
        for i, sampled in enumerate(tokens):
            reason = self._update(req, stream, chunk.output_index + i, sampled)
            self.stats.generated_tokens += 1
            if reason is not None:
                break
        if chunk.draft:
            self.stats.count_draft(len(chunk.draft), len(tokens) - 1)
        if reason is None and chunk.samples_several:
            self.scheduler.accept_tokens(req, len(tokens) - 1)
        return reason

    def _update(self, req: Request, stream: TextStream, index: int, sampled: SampledToken) -> FinishReason | None:
        """The one place a sampled token lands: it replaces its placeholder and advances the
        request's grammar (structured output), then every stop rule is applied in order (stop
        token ids and EOS, stop strings, a grammar that allows nothing more, max_tokens, the
        context), none of them but the grammar's before `min_tokens` tokens are out. The stream
        only reads the token."""
        token = sampled.token_id
        req.land_token(index, token)
        num_out = index + 1
        checking = num_out >= req.params.min_tokens  # vLLM: no stop checks before min_tokens
        stream.add_token(sampled)
        faults.check("stop", req)
        if checking and token in req.stop_token_ids:
            return FinishReason.STOP  # finishing drops a later step's placeholder
        faults.check("detokenize", req)
        stopped = stream.add_text(token, check_stops=checking)
        if stopped or (req.grammar is not None and req.grammar.is_finished):
            return FinishReason.STOP
        return FinishReason.LENGTH if req.ends_by_length(num_out, self.max_model_len) else None

    def _pooled_delta(self, req: Request) -> Delta:
        """End an embedding request whose whole prompt is pooled: the final delta carries the
        pooled vector and generates nothing."""
        embedding = req.pooling.vector()
        self.scheduler.finish(req, FinishReason.STOP)
        delta = self.final_delta(req, FinishReason.STOP)
        delta.embedding = embedding
        return delta

    def fail(self, req: Request, error: BaseException) -> list[Delta]:
        """End one request whose part of an iteration raised; the others go on."""
        logger.error("request %s failed: %r", req.request_id, error, exc_info=error)
        self.stats.failed_requests += 1
        group_id = req.text.group_id
        if not req.is_finished:
            self.scheduler.finish(req, FinishReason.ERROR)
        delta = self.final_delta(req, FinishReason.ERROR, error)
        self.forget_if_finished(group_id)
        return [delta]

    def final_delta(self, req: Request, reason: FinishReason, error: BaseException | None = None) -> Delta:
        usage = Usage(req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_prompt_tokens)
        return req.text.take_delta(reason, usage, error, req.prompt_logprobs)

    def forget_if_finished(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        if group is not None and all(r.is_finished for r in group):
            del self.groups[request_id]
