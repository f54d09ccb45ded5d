"""The state slots of a step's sequences (a hybrid model's: `AttentionMetadata.state_slots`)."""

from __future__ import annotations

import numpy as np

from jaxserve.scheduler.output import ScheduledChunk


def state_slot_rows(
    chunks: list[ScheduledChunk], decodes: list[ScheduledChunk], first_decode: int, num_seqs: int, enabled: bool
) -> np.ndarray | None:
    """[num_seqs] each sequence's state slot: `chunks`' from 0, `decodes`' from `first_decode`, the
    reserved slot 0 for padding; None when the model keeps no per-sequence state (`enabled` off)."""
    if not enabled:
        return None
    out = np.zeros(num_seqs, np.int32)
    out[: len(chunks)] = [c.request.kv.state_slot for c in chunks]
    out[first_decode : first_decode + len(decodes)] = [c.request.kv.state_slot for c in decodes]
    return out
