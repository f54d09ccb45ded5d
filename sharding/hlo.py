"""Collectives in compiled XLA programs: how tests and `bench.mesh_report` check that tensor
parallelism communicates only where the partition rules say it must."""

from __future__ import annotations

import dataclasses
import re

_COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # all-reduce, all-gather, ...
    shape: str  # the result, as HLO prints it: f32[8,64]{1,0}
    op_name: str  # the JAX source path (jit(...)/while/body/.../o_proj/...)
    in_layer_loop: bool  # inside the scan over layers: paid once per layer

    @property
    def module(self) -> str:
        """The Flax module that issued it (o_proj, down_proj, ...), from `op_name`."""
        parts = self.op_name.rsplit("/", 2)
        return parts[-2] if len(parts) >= 2 else ""


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled program's HLO text (`compiled.as_text()`)."""
    found = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            op_name = _OP_NAME.search(line)
            name = op_name.group(1) if op_name else ""
            found.append(Collective(m.group(2), m.group(1), name, "while/body" in name))
    return found
