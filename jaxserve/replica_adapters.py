"""LoRA adapters served alike on every replica of a data-parallel engine."""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.engine_core import EngineCore
from jaxserve.lora.peft import LoraWeights


class ReplicaAdapters:
    """Adds, removes and keeps host copies of adapters on all replicas at once."""

    def __init__(self, replicas: Sequence[EngineCore]) -> None:
        self.replicas = list(replicas)

    def read(self, path: str) -> LoraWeights:
        """An adapter read from disk (ValueError if it cannot be served): safe to call off the
        engine thread; `add` and `keep` take the result."""
        return self.replicas[0].read_lora(path)

    def missing_host_copy(self, name: str) -> str | None:
        """The directory to read for a request of adapter `name` when some replica has no host
        copy of it (safe off the engine thread, at worst a stale answer)."""
        for replica in self.replicas:
            path = replica.missing_lora_host_copy(name)
            if path is not None:
                return path
        return None

    def keep(self, name: str, path: str, weights: LoraWeights) -> None:
        """Hold an adapter read by `read` as `name`'s host copy on every replica."""
        for replica in self.replicas:
            replica.keep_lora(name, path, weights)

    def add(self, name: str, path: str, weights: LoraWeights | None = None) -> None:
        """Serve a LoRA adapter on every replica (none changed when it cannot be served), with
        `weights` from `read(path)` (read here when None)."""
        added: list[EngineCore] = []
        try:
            if weights is None:
                weights = self.read(path)
            for replica in self.replicas:
                replica.add_lora(name, path, weights)
                added.append(replica)
        except ValueError:
            for replica in added:
                replica.remove_lora(name)
            raise

    def remove(self, name: str) -> None:
        for replica in self.replicas:
            replica.remove_lora(name)

    def served(self) -> dict[str, str]:
        """The adapters served: name -> directory (every replica serves the same)."""
        return self.replicas[0].lora_adapters()
