"""The runner's jitted programs, each declared once: the function it runs, its arguments (where each
lies on the mesh, and whether the program takes it over: donated, updated in place), where its
outputs go, and its variants (the buckets it is compiled for, with example arguments of each).
Warm-up compiles every variant of every declaration; serving runs a variant by its bucket, and a
bucket not compiled at warm-up is compiled then, and counted (`ModelRunner.num_compilations`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

Bucket = tuple  # a variant's shape key, e.g. (batch, block-table width)


@dataclasses.dataclass(frozen=True)
class Arg:
    name: str
    sharding: Any
    donated: bool = False


class ProgramSpec:
    """One declared program. `variants()` yields (bucket, example arguments) for warm-up; a
    bucket may come more than once (the first one's arguments are compiled)."""

    def __init__(self, name: str, fn: Callable, args: Sequence[Arg], outs: Any,
                 variants: Callable[[], Iterable[tuple[Bucket, tuple]]]) -> None:
        self.name = name
        self.args = tuple(args)
        self.variants = variants
        self.jitted = jax.jit(fn, donate_argnums=tuple(i for i, a in enumerate(self.args) if a.donated),
                              in_shardings=tuple(a.sharding for a in self.args), out_shardings=outs)

    def key(self, bucket: Bucket) -> tuple:
        """The executable's key: the program's name, then its bucket."""
        return (self.name, *bucket)

    def __repr__(self) -> str:
        args = ", ".join(a.name + (" (donated)" if a.donated else "") for a in self.args)
        return f"ProgramSpec({self.name}: {args})"
