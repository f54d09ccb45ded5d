"""The compiled variants of the declared programs (`programs.py`), and how many compilations there
were: warm-up compiles every variant, so a test can prove that serving after it compiles nothing."""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Any

from jaxserve.runner.device_state import DeviceState
from jaxserve.runner.programs import ProgramSpec

logger = logging.getLogger(__name__)


class Executables:
    def __init__(self, programs: dict[str, ProgramSpec]) -> None:
        self.programs = programs
        self.compiled: dict[tuple, Any] = {}  # by `ProgramSpec.key`
        self.num_compilations = 0

    def run(self, key: tuple, state: DeviceState, inputs: tuple, warming_up: bool = False) -> tuple[DeviceState, Any]:
        """Run the program variant `key` (`ProgramSpec.key`) on `state`, which it takes over:
        compiled at warm-up, or now (counted). Returns the new state and the outputs."""
        exe = self.compiled.get(key)
        if exe is None:
            if not warming_up:
                logger.warning("compiling a new variant at serving time: %s", key)
            exe = self.compiled[key] = self.programs[key[0]].lower(state, *inputs).compile()
            self.num_compilations += 1
        updated, outputs = exe(state.params, state.updatable(), *inputs)
        return state.join(updated), outputs

    def compile_all(self) -> None:
        """Compile every variant of every declared program not compiled yet.

        Tracing and lowering hold the GIL and run one by one on this thread; each lowered
        program goes straight to a pool of a thread per core, so XLA compiles the earlier
        variants while later ones are being traced.
        """
        pending: dict[tuple, concurrent.futures.Future] = {}
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            for spec in self.programs.values():
                for bucket, args in spec.variants():
                    key = spec.key(bucket)
                    if key not in self.compiled and key not in pending:
                        pending[key] = pool.submit(spec.lower(*args).compile)
            for key, compiled in pending.items():
                self.compiled[key] = compiled.result()
        self.num_compilations += len(pending)
