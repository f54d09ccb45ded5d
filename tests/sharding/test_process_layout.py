"""How a multi-process job's processes divide into replica groups (`sharding.process_layout`)."""

from __future__ import annotations

import pytest

from sharding.process_layout import ProcessLayout, plan_processes


def test_one_engine_over_every_process_is_one_group():
    layout = plan_processes(1, devices_per_replica=8, local_devices=2, processes=4)
    assert layout == ProcessLayout(processes=4, processes_per_group=4, replicas_per_group=1)
    assert layout.groups == 1 and list(layout.members(0)) == [0, 1, 2, 3]


def test_a_replica_per_process():
    layout = plan_processes(2, devices_per_replica=1, local_devices=1, processes=2)
    assert (layout.groups, layout.replicas_per_group) == (2, 1)
    assert [layout.group_of(p) for p in range(2)] == [0, 1] and [list(layout.members(g)) for g in (0, 1)] == [[0], [1]]


def test_several_replicas_per_process():
    layout = plan_processes(4, devices_per_replica=2, local_devices=4, processes=2)
    assert (layout.groups, layout.processes_per_group, layout.replicas_per_group) == (2, 1, 2)


def test_replicas_spanning_two_processes_each():
    layout = plan_processes(2, devices_per_replica=4, local_devices=2, processes=4)
    assert layout.groups == 2 and list(layout.members(0)) == [0, 1]
    assert list(layout.members(1)) == [2, 3] and layout.group_of(3) == 1


@pytest.mark.parametrize(
    "dp, per_replica, local, processes, message",
    [
        (
            1,
            1,
            1,
            2,
            r"uses every device of its 2 processes \(2\): .* is 1 x 1 = 1 \(e\.g\. --tensor-parallel-size 2 "
            r"and --data-parallel-size 1, or --data-parallel-size 2\)",
        ),
        (2, 3, 2, 3, r"a replica's 3 devices .* must be whole processes' devices: each process has 2"),
        (3, 2, 3, 2, r"a process's 3 devices must hold whole replicas of 2 devices"),
    ],
)
def test_layouts_that_do_not_fit_say_what_would(dp, per_replica, local, processes, message):
    with pytest.raises(ValueError, match=message):
        plan_processes(dp, per_replica, local, processes)
