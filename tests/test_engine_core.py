"""`EngineCore`, the interface of one engine replica: `LLMEngine` offers every operation with the
declared parameters, and the layers above a replica (the data-parallel engine, the async engine and
its KV export and import, the worker service and KV handoff) never read a replica's scheduler, KV
manager, LoRA manager or runner."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

from jaxserve.engine import LLMEngine
from jaxserve.engine_core import EngineCore

ROOT = pathlib.Path(__file__).resolve().parents[1]
ABOVE_A_REPLICA = [
    "jaxserve/data_parallel.py",
    "jaxserve/replica_adapters.py",
    "jaxserve/async_engine.py",
    "jaxserve/async_kv_transfer.py",
    "server/cluster/worker/service.py",
    "server/cluster/worker/kv_handoff.py",
]
REPLICA_MEMBERS = {"kv", "scheduler", "runner", "lora"}
# Names whose members of those names are not a replica's: a request's adapter (`params.lora`,
# `request.lora`), a snapshot's KV figures (`snapshot.kv`).
NOT_REPLICAS = {"params", "request", "snapshot"}


def callable_or_property(value: object) -> bool:
    return inspect.isfunction(value) or isinstance(value, property)


def _operations() -> dict[str, object]:
    """The methods and properties EngineCore declares (on itself and the protocols it joins)."""
    ops: dict[str, object] = {}
    for cls in EngineCore.__mro__:
        if cls is object or not getattr(cls, "_is_protocol", False):
            continue
        for name, value in vars(cls).items():
            if not name.startswith("_") and callable_or_property(value):
                ops.setdefault(name, value)
    return ops


def test_the_interface_is_a_few_operations_per_concern():
    ops = _operations()
    assert {"add_prompt_ids", "step", "abort", "prefix_match_length", "pin_history", "hold_prefix"} <= set(ops)
    assert {"read_kv_blocks", "write_kv_blocks", "add_lora", "adapter_resident", "load"} <= set(ops)
    for cls in EngineCore.__mro__[1:]:
        if getattr(cls, "_is_protocol", False) and cls.__module__.startswith("jaxserve"):
            declared = [n for n, v in vars(cls).items() if not n.startswith("_") and callable_or_property(v)]
            assert len(declared) <= 11, cls


@pytest.mark.parametrize("name", sorted(_operations()))
def test_llm_engine_offers_the_operation_with_its_parameters(name):
    declared = _operations()[name]
    offered = inspect.getattr_static(LLMEngine, name)
    assert isinstance(offered, property) == isinstance(declared, property), name
    if inspect.isfunction(declared):
        assert list(inspect.signature(offered).parameters) == list(inspect.signature(declared).parameters)


@pytest.mark.parametrize("path", ABOVE_A_REPLICA)
def test_layers_above_a_replica_do_not_reach_into_it(path):
    tree = ast.parse((ROOT / path).read_text())
    reached = [
        f"line {node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in REPLICA_MEMBERS
        and not (isinstance(node.value, ast.Name) and node.value.id in NOT_REPLICAS)
    ]
    assert reached == [], f"{path} reaches into a replica: {reached}"
