"""What the GPU check runs: model shapes (`shapes.py`), kernel grids, engine workloads and stage time
limits, for the GPU run and for the CPU dry run (the same stages and code, with tiny shapes).

Nothing here imports JAX: the supervising process reads the plan without touching a device.
"""

from __future__ import annotations

import dataclasses

from bench.gpu_check.shapes import (
    DEEPSEEK_V3_2L,
    GEMMA3_1B,
    LLAMA3_8B,
    MOE_MODEL,
    QWEN3_MOE_16L,
    SMOLLM2_135M,
    SPEC_MODEL,
    TINY_DEEPSEEK_V3,
    TINY_GEMMA3,
    TINY_LLAMA3,
    TINY_QWEN3_MOE,
    TINY_SMOLLM2,
    WINDOW_MODEL,
)
from checkpoints.config import ModelConfig

# The EngineConfig field that switches overlap (async) scheduling: the host prepares step N+1
# while step N runs. Engine stages run with it on (the default); the small model, whose steps are
# the most host-bound, runs again with it off when time is left.
OVERLAP_FIELD = "async_scheduling"
# Decode steps per device loop of the optional multi-step stage (the small model, whose host share is largest).
MULTI_STEP_K = 8


@dataclasses.dataclass(frozen=True)
class EngineWorkload:
    """Per batch size: that many random token-id prompts of `prompt_len`, each generating
    `max_tokens` greedy tokens (EOS ignored); decode is timed while every sequence decodes."""

    batches: tuple[int, ...]
    prompt_len: int
    max_tokens: int
    max_num_batched_tokens: int
    max_prefill_seqs: int
    block_size: int = 16

    @property
    def max_model_len(self) -> int:
        tokens = self.prompt_len + self.max_tokens
        return -(-tokens // self.block_size) * self.block_size


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage, run in its own process under `limit_s` seconds."""

    name: str
    kind: str  # a key of bench.gpu_check.stage.RUNNERS: env | correctness | decode_kernels | engine | ...
    limit_s: float
    model: str | None = None  # engine stages: a key of Plan.models
    overlap: bool = True  # engine stages: async (overlap) scheduling
    scheduler_steps: int = 1  # engine stages: decode steps per device loop (multi-step decode when > 1)
    unroll_layers: bool = False  # engine stages: the layers unrolled over per-layer weights (no scan)
    command_buffers: bool | None = None  # None: as the run's --triton-command-buffers says
    optional: bool = False  # runs only when the time left covers its whole limit


@dataclasses.dataclass(frozen=True)
class Plan:
    dry_run: bool
    dtype: str  # of the benchmarked kernels, and of the engine's weights and KV cache on a GPU
    models: dict[str, ModelConfig]
    correctness: tuple[tuple[str, str], ...]  # (model, dtype) pairs whose attention shape is checked
    correctness_pages: int  # block-table width of the correctness cases
    decode_model: str  # whose attention shape the decode grid uses
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    reference_max_tokens: int  # the reference runs on decode cases up to batch x context tokens
    prefill_cases: tuple[tuple[int, int, int], ...]  # (sequences, chunk, history)
    copy_bytes: int
    matmul_n: int
    quant_rows: tuple[int, ...]  # stage quantized_matmul: rows of x of each layer matmul
    iters: int
    workload: EngineWorkload
    # The goals apply to decode cases from this batch and context up, and to this batch
    # of the engine on the 8B shape.
    goal_kernel_min_batch: int
    goal_kernel_min_context: int
    goal_engine_batch: int
    budget_s: float  # the whole run, all stages
    stages: tuple[Stage, ...]
    # The engine stages' weights and KV cache: `dtype` on a GPU; float32 in the dry run, since the
    # engine refuses bfloat16 on CPU (XLA:CPU runs it 30-100x slower).
    engine_dtype: str = "bfloat16"

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"stages: {', '.join(s.name for s in self.stages)}; no stage {name!r} in the plan")


def _stages(
    limits: dict[str, float], models: tuple[str, ...], command_buffer_variant: bool, families_optional: bool
) -> tuple[Stage, ...]:
    stages = [
        Stage("env", "env", limits["env"]),
        Stage("correctness", "correctness", limits["correctness"]),
        Stage("decode_kernels", "decode_kernels", limits["decode_kernels"]),
        Stage("prefill_kernels", "prefill_kernels", limits["prefill_kernels"]),
    ]
    for model in models:
        stages.append(Stage(f"engine_{model}", "engine", limits[f"engine_{model}"], model, True))
    stages += _engine_variants(limits, models, command_buffer_variant)
    # Weight-only quantized layer matmuls (int8, 4-bit) against bf16 at the 8B shape (optional on the
    # GPU: in what the others left).
    stages.append(Stage("quantized_matmul", "quantized_matmul", limits["quantized_matmul"], optional=families_optional))
    # The families' blocks: grouped expert matmuls and sliding-window kernels, then the engine on
    # each family's model (on the GPU in what the other stages left: the budget is 8 minutes).
    stages.append(Stage("models", "models", limits["models"]))
    # LoRA: a decode step of rows over 8 adapters against base rows (bench/gpu_check/lora_stage.py).
    stages.append(Stage("lora", "lora", limits["lora"], models[0], optional=families_optional))
    for model in (MOE_MODEL, WINDOW_MODEL):
        stages.append(Stage(f"engine_{model}", "engine", limits[f"engine_{model}"], model, optional=families_optional))
    # The 2026 families' kernels: MLA decode (mla_stage.py), the Gated DeltaNet delta rule (hybrid_stage.py).
    stages += [Stage(name, name, limits[name], optional=families_optional) for name in ("mla_decode_kernel", "hybrid")]
    # MTP speculative decoding's costs against plain decoding on the same model (spec_stage.py).
    stages.append(Stage("speculative", "speculative", limits["speculative"], SPEC_MODEL, optional=families_optional))
    # Gemma 3 4B's vision tower as the runner serves it: checked, and timed per image (vision_stage.py).
    stages.append(Stage("vision_encoder", "vision_encoder", limits["vision_encoder"], optional=families_optional))
    return tuple(stages)


def _engine_variants(limits: dict[str, float], models: tuple[str, ...], command_buffer_variant: bool) -> list[Stage]:
    """The optional engine stages: the synchronous loop, multi-step decode, unrolled layers and
    (GPU only) command buffers off."""
    stages: list[Stage] = []
    # The optional stages run only in what the others left; the small model's steps are the most
    # launch-bound, so they show the host's share and the command buffers' effect best.
    stages.append(
        Stage(f"engine_{models[0]}_sync", "engine", limits[f"engine_{models[0]}"], models[0], False, optional=True)
    )
    stages.append(
        Stage(
            f"engine_{models[0]}_multistep",
            "engine",
            limits[f"engine_{models[0]}"],
            models[0],
            scheduler_steps=MULTI_STEP_K,
            optional=True,
        )
    )
    # Whether the scan over stacked layers costs a copy of each layer's weights per step (as on
    # XLA:CPU): the large model's weight-bound decode, unrolled, against its scanned stage.
    stages.append(
        Stage(
            f"engine_{models[-1]}_unrolled",
            "engine",
            limits[f"engine_{models[-1]}"],
            models[-1],
            unroll_layers=True,
            optional=True,
        )
    )
    if command_buffer_variant:
        stages.append(
            Stage(
                f"engine_{models[0]}_no_cmdbuf",
                "engine",
                limits[f"engine_{models[0]}"],
                models[0],
                True,
                command_buffers=False,
                optional=True,
            )
        )
    return stages


def make_plan(dry_run: bool, command_buffer_variant: bool) -> Plan:
    """The GPU plan (one H100 or H200, under 9 minutes: one call of the device tool) or the dry-run plan
    (2 CPU cores: 1-8 minutes, more on a loaded machine).
    command_buffer_variant: add an engine stage with Triton command buffers off (GPU only)."""
    if dry_run:
        return _dry_run_plan()
    return _gpu_plan(command_buffer_variant)


_MODELS = ("smollm2-135m", "llama3-8b")


def _dry_run_plan() -> Plan:
    # A quiet 2-core CPU takes a fifth to a third of these; the margin is for a busy or throttled
    # CI machine (at load average 12 an engine stage took 200 s), where a limit hit would fail
    # the run, not measure anything.
    limits = {
        "env": 150,
        "correctness": 300,
        "decode_kernels": 300,
        "prefill_kernels": 200,
        "engine_smollm2-135m": 300,
        "engine_llama3-8b": 300,
        "models": 200,
        f"engine_{MOE_MODEL}": 300,
        f"engine_{WINDOW_MODEL}": 300,
        "quantized_matmul": 150,
        "lora": 300,
        "mla_decode_kernel": 200,
        "hybrid": 150,
        "speculative": 300,
        "vision_encoder": 150,
    }
    return Plan(
        dry_run=True,
        dtype="bfloat16",
        engine_dtype="float32",
        models={
            "smollm2-135m": TINY_SMOLLM2,
            "llama3-8b": TINY_LLAMA3,
            MOE_MODEL: TINY_QWEN3_MOE,
            WINDOW_MODEL: TINY_GEMMA3,
            SPEC_MODEL: TINY_DEEPSEEK_V3,
        },
        correctness=(("smollm2-135m", "float32"), ("llama3-8b", "bfloat16")),
        correctness_pages=4,
        decode_model="llama3-8b",
        decode_batches=(4,),
        decode_contexts=(64, 256),
        reference_max_tokens=2**21,
        prefill_cases=((2, 16, 24), (1, 32, 0)),
        copy_bytes=16 * 2**20,
        matmul_n=256,
        quant_rows=(1, 8),
        iters=2,
        workload=EngineWorkload(
            batches=(4,), prompt_len=24, max_tokens=12, max_num_batched_tokens=128, max_prefill_seqs=4
        ),
        goal_kernel_min_batch=4,
        goal_kernel_min_context=256,
        goal_engine_batch=4,
        budget_s=1700,
        stages=_stages(limits, _MODELS, False, families_optional=False),
    )


def _gpu_plan(command_buffer_variant: bool) -> Plan:
    # The limits add up to the budget, so a stage that overruns never eats into a later one's time;
    # the optional stage runs only in what the others left.
    # decode_kernels times two decode kernels, JAX's op and the copy over 12 cases (compiles included).
    limits = {
        "env": 30,
        "correctness": 70,
        "decode_kernels": 170,
        "prefill_kernels": 40,
        "engine_smollm2-135m": 70,
        "engine_llama3-8b": 130,
        "models": 40,
        f"engine_{MOE_MODEL}": 90,
        f"engine_{WINDOW_MODEL}": 70,
        "quantized_matmul": 40,
        "lora": 60,
        "mla_decode_kernel": 40,
        "hybrid": 40,
        "speculative": 90,
        "vision_encoder": 90,
    }
    return Plan(
        dry_run=False,
        dtype="bfloat16",
        models={
            "smollm2-135m": SMOLLM2_135M,
            "llama3-8b": LLAMA3_8B,
            MOE_MODEL: QWEN3_MOE_16L,
            WINDOW_MODEL: GEMMA3_1B,
            SPEC_MODEL: DEEPSEEK_V3_2L,
        },
        correctness=tuple((m, d) for m in _MODELS for d in ("float32", "bfloat16")),
        correctness_pages=64,
        decode_model="llama3-8b",
        decode_batches=(1, 8, 64, 256),
        decode_contexts=(512, 4096, 32768),
        # The reference gathers every sequence's pages into a copy: 2M tokens of 8 x 128 bf16
        # K and V are 8.6 GB (plus the pool); past that only ours and JAX's kernel run.
        reference_max_tokens=2**21,
        prefill_cases=((4, 512, 0), (4, 512, 4096), (16, 128, 2048), (1, 4096, 0)),
        copy_bytes=2**30,
        matmul_n=8192,
        quant_rows=(1, 16, 64, 256),
        iters=20,
        workload=EngineWorkload(
            batches=(1, 64, 256), prompt_len=512, max_tokens=64, max_num_batched_tokens=8192, max_prefill_seqs=16
        ),
        goal_kernel_min_batch=64,
        goal_kernel_min_context=4096,
        goal_engine_batch=64,
        budget_s=550,
        stages=_stages(limits, _MODELS, command_buffer_variant, families_optional=True),
    )
