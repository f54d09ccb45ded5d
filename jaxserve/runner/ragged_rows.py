"""The arrays of a ragged prefill program (`StepInputs.prefill`): `num_tokens` token rows, the chunks'
sequences then `num_decodes` decode sequences in the attention metadata, and the rows whose logits it
samples (at most max_num_seqs, -1 for padding: `DecoderModel`'s head skips them)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class RaggedRows:
    tokens: np.ndarray  # i32[num_tokens]
    token_src: np.ndarray  # i32[num_tokens]: a token still in flight, its row in the sampled buffer (-1: known)
    positions: np.ndarray  # i32[num_tokens]
    kv_slots: np.ndarray  # i32[num_tokens]: the KV slot each row's K/V is written to
    seq_lens: np.ndarray  # i32[num_seqs + num_decodes]
    query_start: np.ndarray  # i32[num_seqs + 1]: the chunks' first rows
    logits_indices: np.ndarray  # i32[sampled rows]
    tables: np.ndarray  # i32[num_seqs + num_decodes, width]

    @classmethod
    def empty(cls, num_tokens: int, num_seqs: int, num_decodes: int, width: int, num_logits: int) -> RaggedRows:
        """All padding: rows of token 0 at position 0 writing into block 0, sequences of length 0."""
        return cls(
            np.zeros(num_tokens, np.int32),
            np.full(num_tokens, -1, np.int32),
            np.zeros(num_tokens, np.int32),
            np.zeros(num_tokens, np.int32),
            np.zeros(num_seqs + num_decodes, np.int32),
            np.zeros(num_seqs + 1, np.int32),
            np.full(num_logits, -1, np.int32),
            np.zeros((num_seqs + num_decodes, width), np.int32),
        )
