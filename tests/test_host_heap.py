"""The runner keeps freed host blocks in the heap (jaxserve/runner/host_heap.py): a block as
large as XLA:CPU's per-step temporaries, freed and allocated again, is not faulted in again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Run in a fresh interpreter: the setting is process-wide, and another test's runner may have set it.
CHILD = textwrap.dedent("""
    import ctypes, ctypes.util, resource
    from jaxserve.runner.host_heap import keep_freed_blocks

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)

    def touch_and_free(nbytes):
        block = libc.malloc(nbytes)
        ctypes.memset(block, 1, nbytes)
        libc.free(block)

    def refault_pages(nbytes):
        touch_and_free(nbytes)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        touch_and_free(nbytes)  # the same size again
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    nbytes = 40 << 20
    default = refault_pages(nbytes)
    print(keep_freed_blocks(), default, refault_pages(nbytes), nbytes // 4096)
""")


def test_a_freed_step_sized_block_is_reused_without_page_faults():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    kept, default, kept_faults, pages = done.stdout.split()
    if kept != "True":
        pytest.skip("the C library has no glibc mallopt")
    # glibc's default maps a 40 MB block afresh each time: every page faults again.
    assert int(default) > int(pages) // 2
    assert int(kept_faults) < int(pages) // 20
