"""The dtype a serving benchmark records is the one its jaxserve server runs."""

from __future__ import annotations

from bench.serve import server_dtype
from jaxserve.config import EngineConfig
from jaxserve.dtype_choice import choose_dtype


def test_an_explicit_dtype_is_recorded_as_given():
    assert server_dtype(["--max-num-seqs", "4", "--dtype", "float32"]) == "float32"
    assert server_dtype(["--dtype=bfloat16"]) == "bfloat16"


def test_no_dtype_records_what_the_servers_auto_picks_on_this_machine():
    assert server_dtype(["--max-num-seqs", "4"]) == choose_dtype(EngineConfig())[0]
    # auto keeps float32 beyond one device (the bf16 C++ matmuls run on one device only)
    assert server_dtype(["--tensor-parallel-size", "2"]) == "float32"
