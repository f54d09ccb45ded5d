"""Prompt lookup: draft tokens proposed from the sequence itself (numpy, no JAX).

The sequence's last n tokens, for n from `max_n` down to `min_n`, are looked for earlier in the
sequence (prompt and output); at the latest earlier occurrence of the longest n that has one,
the (up to) k tokens that followed it are the draft. Copying workloads (editing or summarising
a given text, code) repeat long spans, so the draft is often what the model would say next.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens continuing `token_ids`, or [] when no n-gram recurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length - n - 1: each is followed by at least one token, and
        # none is the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
