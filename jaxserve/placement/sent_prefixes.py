"""What a placer sent one target, as its picture of that target's cache and LoRA slots.

A LoRA request's prompt is keyed behind a negative token no prompt has (the adapter's number
here), so a prefix sent with one adapter never matches another's or the base model's. An adapter
loaded again under the same name may be other weights: `forget_adapter` gives the name a fresh
number, so nothing sent under the old one matches.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from jaxserve.placement.prefix_tree import ApproxPrefixTree


class SentPrefixes:
    """One target's approximate prefix cache and the adapters taken as resident in its LoRA slots (those
    of the latest requests sent there, most recent last)."""

    def __init__(self, max_tokens: int = 1 << 20) -> None:
        self.tree = ApproxPrefixTree(max_tokens)
        self.recent_adapters: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._numbers: dict[str, int] = {}
        self._next_number = 1

    def key(self, token_ids: Sequence[int], lora: str | None) -> list[int]:
        """`token_ids` as the tree keys them for adapter `lora` (None: the base model)."""
        ids = list(token_ids)
        if lora is None:
            return ids
        if lora not in self._numbers:
            self._numbers[lora] = self._next_number
            self._next_number += 1
        return [-self._numbers[lora], *ids]

    def note(self, token_ids: Sequence[int], lora: str | None, lora_slots: int = 1) -> None:
        """A prompt was sent (with `lora`'s adapter, if any): it is in the picture, its adapter
        among those taken as resident (the latest `lora_slots`)."""
        self.tree.insert(self.key(token_ids, lora))
        if lora is not None:
            self.recent_adapters[lora] = None
            self.recent_adapters.move_to_end(lora)
            while len(self.recent_adapters) > lora_slots:
                self.recent_adapters.popitem(last=False)

    def match(self, token_ids: Sequence[int], lora: str | None) -> int:
        """Tokens of `token_ids` the target probably has cached for `lora` (marks them recently used)."""
        return self.tree.match(self.key(token_ids, lora))

    def forget_adapter(self, name: str) -> None:
        """`name` is (re)loaded or unloaded: nothing sent under it so far matches from now on."""
        self._numbers.pop(name, None)

    def clear(self) -> None:
        """The target restarted: it holds nothing."""
        self.tree.clear()
        self.recent_adapters.clear()
