"""Test-wide settings: CPU only, and one persistent compilation cache for the whole run so that
engines built with the same shapes in different tests compile each variant once (shared by the
pytest-xdist workers, which the README's test command starts, one per core)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    from jaxserve.runner import enable_persistent_compilation_cache

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    enable_persistent_compilation_cache(str(root / "xla-cache"))


def _assert_kv_all_free(engine) -> None:
    """No request left and every device block free or reclaimable (cached, held by nobody)."""
    assert not engine.has_unfinished_requests(), "requests left in the engine"
    kv = engine.kv
    kv.check_integrity()
    usage = kv.usage()
    assert not kv.num_live_handles, f"{kv.num_live_handles} KV tables left"
    assert usage.used == 0 and usage.pinned == 0, f"KV blocks leaked: {usage}"
    assert usage.free + usage.cached_idle == usage.num_blocks, f"KV accounting off: {usage}"
    assert usage.host_swapped == 0, f"swapped blocks leaked: {usage}"
    # A hybrid model's state slots: each free or keeping a snapshot (reclaimable, as idle cached blocks are).
    slots, kept = kv.state_slots, kv.snapshots.num_held
    assert slots.num_free + kept == max(slots.num_slots - 1, 0), (
        f"state slots leaked: {slots.num_free} free, {kept} kept"
    )
    draft = getattr(engine.proposer, "kv", None)  # a draft model's own KV pool (speculative decoding)
    if draft is not None:
        draft.pool.check_integrity()
        assert draft.num_used == 0 and not draft.sequences, f"draft KV leaked: {draft.num_used} blocks"


@pytest.fixture
def assert_kv_all_free():
    return _assert_kv_all_free


@pytest.fixture(scope="module")
def master():
    """A running `mooncake_master` (the KV pool's), one per test module; killed after it. Modules that
    use it skip first where Mooncake cannot run (`mooncake_missing`)."""
    from server.cluster.launch.mooncake_master import PoolMaster

    m = PoolMaster()
    m.start()
    yield m
    m.kill()
