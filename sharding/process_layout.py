"""How the processes of a multi-process job divide into engines (no JAX here: counts only).

A job's `dp x pp x ep x tp` devices form `dp` data-parallel replicas. Each replica lives on whole
processes: either one process holds one or more replicas (`pp x ep x tp` divides its devices), or
one replica spans several consecutive processes (`pp x ep x tp` is a multiple of a process's
devices). Consecutive processes that hold the same replicas form a *replica group*; its first
process, the group's leader, schedules the group's engine and the others replay its device
operations (`sharding.multihost`). With one group (dp = 1) process 0 serves the engine itself; with
several, every leader serves its engine as a worker and process 0 routes over them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """`processes` processes in groups of `processes_per_group`; each group runs one engine of
    `replicas_per_group` data-parallel replicas over its processes' devices."""

    processes: int
    processes_per_group: int
    replicas_per_group: int

    @property
    def groups(self) -> int:
        return self.processes // self.processes_per_group

    def group_of(self, process: int) -> int:
        return process // self.processes_per_group

    def members(self, group: int) -> range:
        """The processes of `group`, its leader first."""
        return range(group * self.processes_per_group, (group + 1) * self.processes_per_group)


def plan_processes(
    data_parallel_size: int, devices_per_replica: int, local_devices: int, processes: int
) -> ProcessLayout:
    """The layout of `data_parallel_size` replicas of `devices_per_replica` (pp x ep x tp) devices
    over `processes` processes of `local_devices` devices each; ValueError saying what would fit."""
    total = local_devices * processes
    example = (
        (
            f"e.g. --tensor-parallel-size {total} and --data-parallel-size 1, or --tensor-parallel-size "
            f"{local_devices} and --data-parallel-size {processes}"
        )
        if processes > 1 and local_devices > 1
        else f"e.g. --tensor-parallel-size {total} and --data-parallel-size 1, or --data-parallel-size {total}"
    )
    if data_parallel_size * devices_per_replica != total:
        raise ValueError(
            f"a multi-process job uses every device of its {processes} processes ({total}): data-parallel size x "
            f"pipeline x expert x tensor parallel size is {data_parallel_size} x {devices_per_replica} = "
            f"{data_parallel_size * devices_per_replica} ({example})"
        )
    if devices_per_replica >= local_devices:
        if devices_per_replica % local_devices:
            raise ValueError(
                f"a replica's {devices_per_replica} devices (pipeline x expert x tensor parallel size) must be whole "
                f"processes' devices: each process has {local_devices} ({example})"
            )
        return ProcessLayout(processes, devices_per_replica // local_devices, 1)
    if local_devices % devices_per_replica:
        raise ValueError(
            f"a process's {local_devices} devices must hold whole replicas of {devices_per_replica} devices "
            f"(pipeline x expert x tensor parallel size) ({example})"
        )
    return ProcessLayout(processes, 1, local_devices // devices_per_replica)
