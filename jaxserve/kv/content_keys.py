"""Content keys of KV blocks: a chained hash of the tokens up to and including a block.

A block's KV depends on every token before it, and on everything that changes the bytes of
the cache: the model's weights, the dtype, the block size, the kv-head layout, ... Those are
folded into a `fingerprint` that seeds the chain, so two engines agree on a key exactly when
they would have computed the same bytes:

    key[-1] = fingerprint
    key[i]  = blake2b(key[i-1] || int32 bytes of tokens[i*bs:(i+1)*bs]), 16 bytes

`ChainKeys` memoizes the chain of one growing token sequence (a request's tokens only ever get
longer), so matching a waiting request again every step costs nothing after the first time.

LoRA: the prefix cache (keyed by tokens) keeps adapters apart by a request's first token, salted
with this process's number for its adapter (`salt_token`). That number is the engine's own, so
content keys hash the token unsalted (`content_token_bytes`) and salt the chain's seed with the adapter's
weights digest instead (`ChainKeys.salted`): every engine, restart and router agrees on them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence

import numpy as np

KEY_BYTES = 16
TOKEN_BYTES = 4  # token ids are keyed as int32
assert array("i").itemsize == TOKEN_BYTES
TOKEN_BITS = 20  # a salted token keeps its id in these bits: vocabularies up to 2**20
_TOKEN_MASK = (1 << TOKEN_BITS) - 1


def salt_token(uid: int, token: int) -> int:
    """`token` salted by the adapter this process numbers `uid`: a negative id (see the module docstring)."""
    return -1 - ((uid << TOKEN_BITS) | token)


def token_bytes(tokens: Sequence[int] | np.ndarray, num_tokens: int) -> bytes:
    """The first `num_tokens` token ids as int32 bytes, salted ones as they are: the radix tree's keys."""
    if isinstance(tokens, np.ndarray):
        return np.ascontiguousarray(tokens[:num_tokens], dtype=np.int32).tobytes()
    return array("i", tokens[:num_tokens]).tobytes()


def content_token_bytes(tokens: Sequence[int] | np.ndarray, start: int, stop: int) -> bytes:
    """`token_bytes` of a sequence's cache tokens [start, stop) as content keys hash them and the tiers
    store them with a block: the sequence's first token unsalted (a LoRA request's; other salted ids,
    an image's soft tokens, are content and stay)."""
    if start == 0 and stop > 0 and tokens[0] < 0:
        return token_bytes([(-1 - int(tokens[0])) & _TOKEN_MASK, *tokens[1:stop]], stop)
    return token_bytes(tokens[start:stop], stop - start)


def fingerprint(fields: Mapping[str, object]) -> bytes:
    """A 16-byte digest of everything that changes a block's bytes (sorted `name=value` pairs)."""
    if not fields:
        raise ValueError("a fingerprint needs at least one field")
    text = "\n".join(f"{name}={fields[name]!r}" for name in sorted(fields))
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def next_key(previous: bytes, block_tokens: bytes) -> bytes:
    """The key of a block from the key before it and the block's tokens as int32 bytes."""
    return hashlib.blake2b(previous + block_tokens, digest_size=KEY_BYTES).digest()


def chain_keys(seed: bytes, tokens: Sequence[int] | np.ndarray, num_blocks: int, block_size: int) -> list[bytes]:
    """Keys of the first `num_blocks` full blocks of `tokens`."""
    return ChainKeys(seed, block_size).keys(tokens, num_blocks)


class ChainKeys:
    """The chain of keys of one token sequence that only grows; computed as far as asked."""

    __slots__ = ("seed", "block_size", "_keys")

    def __init__(self, seed: bytes, block_size: int) -> None:
        if len(seed) != KEY_BYTES:
            raise ValueError(f"the seed must be {KEY_BYTES} bytes, got {len(seed)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.seed = seed
        self.block_size = block_size
        self._keys: list[bytes] = []

    def salted(self, salt: bytes) -> ChainKeys:
        """A new chain whose seed also covers `salt` (a LoRA adapter's digest): KV computed with
        other weights gets other keys, here and in the disk tier across restarts."""
        return ChainKeys(next_key(self.seed, salt), self.block_size)

    def fork(self) -> ChainKeys:
        """A copy that goes on with another continuation of the tokens seen so far."""
        other = ChainKeys(self.seed, self.block_size)
        other._keys = list(self._keys)
        return other

    def keys(self, tokens: Sequence[int] | np.ndarray, num_blocks: int) -> list[bytes]:
        """Keys of blocks [0, num_blocks) of `tokens` (which must extend the tokens seen before)."""
        bs = self.block_size
        if num_blocks * bs > len(tokens):
            raise ValueError(f"{num_blocks} blocks need {num_blocks * bs} tokens, got {len(tokens)}")
        keys = self._keys
        done = len(keys)
        if num_blocks > done:
            data = content_token_bytes(tokens, done * bs, num_blocks * bs)
            step = bs * 4
            previous = keys[-1] if keys else self.seed
            for i in range(num_blocks - done):
                previous = next_key(previous, data[i * step : (i + 1) * step])
                keys.append(previous)
        return keys[:num_blocks]


class PathSeeds:
    """The seed of a cached path's content keys, told by the path's first token: the engine's seed, or
    for a LoRA request's path (its first token salted) the seed salted by the adapter's weights digest,
    noted when a request of that adapter met the cache (`note`). A salted first token names one
    adapter's weights for the engine's life (its numbers for adapters are never reused)."""

    def __init__(self, seed: bytes) -> None:
        self.seed = seed
        self._salted: dict[int, bytes] = {}  # salted first token -> the seed of its requests' chains

    def note(self, chain: ChainKeys, tokens: Sequence[int] | np.ndarray) -> None:
        """A request with content keys `chain` and cache tokens `tokens` meets the cache."""
        if len(tokens) and tokens[0] < 0:
            self._salted[int(tokens[0])] = chain.seed

    def of(self, tokens: Sequence[int] | np.ndarray) -> bytes | None:
        """The seed of the keys of a path of `tokens` (None: a LoRA path no request noted)."""
        if len(tokens) and tokens[0] < 0:
            return self._salted.get(int(tokens[0]))
        return self.seed
