"""The LoRA operations of `EngineCore` (`ReplicaLora`) over the engine's LoRA manager: `LLMEngine`
inherits them (through `EngineCoreOps`), so callers above a replica never read its LoRA manager."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.engine_client import UnknownAdapterError
from jaxserve.lora.peft import LoraWeights

if TYPE_CHECKING:
    from jaxserve.lora.manager import LoraManager


class ReplicaLoraOps:
    """Adapters served by one engine and their host copies (see jaxserve/lora/manager.py)."""

    lora: LoraManager | None

    def _lora_or_raise(self) -> LoraManager:
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled (start the engine with enable_lora)")
        return self.lora

    def add_lora(self, name: str, path: str, weights: LoraWeights | None = None) -> None:
        """Serve the PEFT adapter at `path` as model `name` (ValueError if it cannot be served),
        with `weights` that `read_lora(path)` returned, or read now."""
        self._lora_or_raise().add(name, path, weights)

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter `name` (UnknownAdapterError if it is not served); its running
        requests finish."""
        if self.lora is None or name not in self.lora.names():
            raise UnknownAdapterError(f"no LoRA adapter named {name!r} is loaded")
        self.lora.remove(name)

    def lora_adapters(self) -> dict[str, str]:
        """The adapters served: name -> directory."""
        return {} if self.lora is None else self.lora.names()

    def lora_adapter_digests(self) -> dict[str, bytes]:
        """The adapters served: name -> weights digest (`LoraManager.digests`; safe off the engine thread)."""
        return {} if self.lora is None else self.lora.digests()

    # Host copies, read off the engine thread.

    def read_lora(self, path: str) -> LoraWeights:
        """An adapter read from disk (ValueError if it cannot be served): safe off the engine thread."""
        return self._lora_or_raise().read(path)

    def missing_lora_host_copy(self, name: str) -> str | None:
        """The directory to read when this engine has no host copy of adapter `name` (a plain
        dict read: safe off the engine thread, at worst a stale answer)."""
        return None if self.lora is None else self.lora.missing_host_copy(name)

    def keep_lora(self, name: str, path: str, weights: LoraWeights) -> None:
        """Hold adapter weights read by `read_lora` as `name`'s host copy."""
        self._lora_or_raise().keep(name, path, weights)
