"""Draft-model speculation: a smaller model of the same tokenizer drafts k tokens per decode as a chain.

`DraftModelProposer` implements `Proposer`. Each step it is asked for drafts (few requests running, as for
n-gram drafts: the engine reads the step in flight first, so every token is known), it runs the draft model
once over the decodes (`draft_programs.draft_chain`): each request's tokens the draft has not computed yet
(the target's accepted drafts and its token after them; a new request's whole prompt, in chunks if it is
longer than the largest token bucket) are prefilled into the draft's own KV cache (`DraftKV`), then k
tokens are drafted. The target verifies them in one step (`jaxserve.speculative.verify`); the draft's K/V
past the last accepted token is overwritten by the next catch-up. The request's draft blocks are freed when
the scheduler releases it (finish, abort, failure, preemption).

With temperature > 0 a request's drafts are drawn from the draft's distribution q, which goes to the verify
step with them (`drafted_probs`) for rejection sampling that keeps the target's distribution.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxserve.config import bucket_for
from jaxserve.request import PLACEHOLDER, Request
from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.draft_kv import DraftKV, DraftSequence
from jaxserve.speculative.draft_length import DraftLength
from jaxserve.speculative.draft_programs import DraftInputs, DraftPrograms

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DraftStats:
    """What drafting cost: model calls (catch-up chunks included), drafting steps, seconds in the draft."""

    calls: int = 0
    steps: int = 0
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class DraftShapes:
    """The draft program's buckets: sequences (the verify batches), new tokens per sequence count, widths."""

    seqs: tuple[int, ...]
    tokens: dict[int, tuple[int, ...]]
    widths: tuple[int, ...]

    @classmethod
    def for_config(
        cls, seqs: tuple[int, ...], k: int, prefill: tuple[int, ...], widths: tuple[int, ...]
    ) -> DraftShapes:
        """Per sequence bucket S: a bucket of S * (k + 1) tokens (a step's catch-up after verification) rounded
        up to a power of two, then the target's prefill token buckets above it (a prompt's catch-up)."""
        tokens = {}
        for s in seqs:
            small = 1 << (s * (k + 1) - 1).bit_length()
            tokens[s] = tuple(sorted({small, *(t for t in prefill if t > small)}))
        return cls(tuple(seqs), tokens, tuple(widths))

    def variants(self) -> list[tuple[int, int, int]]:
        return [(s, t, w) for s in self.seqs for t in self.tokens[s] for w in self.widths]


class DraftModelProposer:
    """Its row at position p takes the request's token t_{p + offset}: a draft model's, t_p (it computes every
    known token; the MTP proposer, `offset` 1, computes position p from t_{p+1} and the target's hidden state)."""

    offset = 0
    wants_hidden = False  # the target's hidden states are not needed (`MtpProposer` takes them)

    def __init__(
        self,
        spec: SpeculativeConfig,
        max_model_len: int,
        device: DraftDevice,
        shapes: DraftShapes,
        programs: DraftPrograms | None = None,
    ):
        self.spec = spec
        self.max_model_len = max_model_len
        self.device = device
        self.shapes = shapes
        self.kv = DraftKV(device.num_blocks, device.block_size)
        self.programs = programs or DraftPrograms(
            device.model, device.block_size, spec.num_speculative_tokens, shapes.variants()
        )
        self.stats = DraftStats()
        self.draft_length = DraftLength(spec.num_speculative_tokens, spec.adaptive_draft_length)
        self.drafted_probs: dict[Request, np.ndarray] = {}  # q of each sampled request's last draft [k, V]

    @property
    def num_compilations(self) -> int:
        return self.programs.num_compilations

    @property
    def draft_seconds(self) -> float:
        return self.stats.seconds

    def warm_up(self) -> None:
        """Compile every variant of the draft program."""
        self.programs.compile_all(self.device.params, self.device.cache)

    def may_propose(self, num_running: int) -> bool:
        return num_running <= self.spec.disable_by_batch_size and self.draft_length.choose(num_running) > 0

    def on_scheduled(self, looked_up: bool, drafted: bool) -> None:
        """Nothing to adapt: the draft model drafts whenever it may."""

    def draft_probs(self, request: Request) -> np.ndarray | None:
        return self.drafted_probs.get(request)

    def release(self, request: Request) -> None:
        self.kv.free(request)
        self.drafted_probs.pop(request, None)

    def propose(self, decodes: Sequence[Request], num_running: int) -> dict[Request, list[int]] | None:
        """None unless `may_propose` and every decode's context has room for a verify step; else a draft
        for each decode that may get one ([] when the draft's pool has no room for it)."""
        room = self.max_model_len - self.spec.num_speculative_tokens
        if not decodes or not self.may_propose(num_running) or any(r.num_tokens > room for r in decodes):
            return None
        t0 = time.perf_counter()
        k = self.draft_length.choose(num_running)
        drafts: dict[Request, list[int]] = {}
        ready: list[tuple[Request, DraftSequence]] = []
        for req in decodes:
            n = self._draft_len(req, k)
            if n is None:
                continue
            seq = self.kv.reserve(req, self._known(req) + k - 1)  # the chain writes d_1 .. d_{k-1} too
            drafts[req] = []
            if seq is not None:
                ready.append((req, seq))
        largest = self.shapes.seqs[-1]
        for i in range(0, len(ready), largest):
            drafts.update(self._draft_group(ready[i : i + largest], k))
        self.stats.steps += 1
        self.stats.seconds += time.perf_counter() - t0
        return drafts

    def _known(self, req: Request) -> int:
        """Positions the model can compute for the request (each needs its token t_{p + offset})."""
        return req.num_tokens - self.offset

    def take_hidden(self, rows: Sequence[Any]) -> None:
        """Nothing: a draft model reads no hidden states of the target."""

    def _draft_len(self, req: Request, k: int) -> int | None:
        """Tokens the request may be drafted, at most `k` (as `NgramProposer._draft`); None: not drafted for."""
        n = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
        if n <= 0 or req.grammar is not None or PLACEHOLDER in req.output_token_ids[-1:]:
            return None
        return n

    def _draft_group(self, group: list[tuple[Request, DraftSequence]], k: int) -> dict[Request, list[int]]:
        """Catch up the group's sequences (in chunks while they exceed the largest token bucket), then draft k."""
        largest = self.shapes.tokens[bucket_for(len(group), self.shapes.seqs)][-1]
        while sum(self._known(r) - s.num_computed for r, s in group) > largest:
            budget, chunk = largest, []
            for req, seq in group:
                n = min(self._known(req) - seq.num_computed - 1, budget)  # the last row waits for the drafting pass
                if n > 0:
                    chunk.append((req, seq, n))
                    budget -= n
            self._run(chunk)
        drafts, probs = self._run([(req, seq, self._known(req) - seq.num_computed) for req, seq in group], k)
        out = {}
        for i, (req, _) in enumerate(group):
            n = self._draft_len(req, k)
            out[req] = drafts[i, :n].tolist()
            if req.params.temperature > 0:
                self.drafted_probs[req] = np.asarray(probs[i, :n])
            else:
                self.drafted_probs.pop(req, None)
        return out

    def _run(self, chunk: list[tuple[Request, DraftSequence, int]], num_drafts: int = 1) -> tuple[np.ndarray, Any]:
        """Prefill each sequence's next n tokens into the draft cache and draft `num_drafts` after them (one for a
        catch-up alone): drafts [S, k] on the host, q [S, k, V] on the device (read only for sampled requests)."""
        x = self._inputs(chunk, num_drafts)
        self.device.cache, drafts, probs = self.programs.run(self.device.params, self.device.cache, x)
        for _, seq, n in chunk:
            seq.num_computed += n
        self.stats.calls += 1
        sampled = any(req.params.temperature > 0 for req, _, _ in chunk)
        return np.asarray(jax.device_get(drafts)), (jax.device_get(probs) if sampled else None)

    def _inputs(self, chunk: list[tuple[Request, DraftSequence, int]], num_drafts: int) -> DraftInputs:
        bs, shapes = self.device.block_size, self.shapes
        seqs = bucket_for(len(chunk), shapes.seqs)
        total = sum(n for _, _, n in chunk)
        width = bucket_for(max(len(s.blocks) for _, s, _ in chunk), shapes.widths)
        x = DraftInputs.zeros(seqs, bucket_for(total, shapes.tokens[seqs]), width)
        x.num_drafts[...] = num_drafts
        row = 0
        for i, (req, seq, n) in enumerate(chunk):
            start = seq.num_computed
            positions = np.arange(start, start + n)
            table = self.kv.table(seq, width)
            x.tokens[row : row + n] = req.copy_tokens(start + self.offset, start + n + self.offset)
            x.positions[row : row + n] = positions
            x.kv_slots[row : row + n] = table[positions // bs] * bs + positions % bs
            x.tables[i] = table
            x.seq_lens[i] = start + n
            x.last_rows[i] = row + n - 1
            x.temperature[i] = max(req.params.temperature, 0.0)
            seed = req.seed % (1 << 64)
            x.seeds[i] = (seed >> 32, seed & 0xFFFFFFFF)
            row += n
            x.query_start[i + 1] = row
        x.query_start[len(chunk) + 1 :] = row
        return x


@dataclasses.dataclass
class DraftDevice:
    """The draft model on the device: its module, parameters and its own KV cache (taken over by each call)."""

    model: Any  # DecoderModel
    params: Any
    cache: Any  # KVCache
    num_blocks: int
    block_size: int
