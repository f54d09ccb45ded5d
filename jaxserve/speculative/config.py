"""`--speculative-config`: one type, with vLLM's names (`method`, `num_speculative_tokens`, `model`,
`prompt_lookup_min`, `prompt_lookup_max`) plus `disable_by_batch_size`, the largest decode batch that still
speculates (drafts pay where a step is bound by reading the weights, i.e. small batches; a large batch
already uses the weights well and would only pay for the rejected rows), and `adaptive_draft_length` (on by
default: each step's draft length, 0 included, is chosen by a cost model measured online,
`jaxserve.speculative.draft_length`; off: `num_speculative_tokens` every step).

Methods: "ngram" (prompt lookup), "draft_model" (a smaller model of the same tokenizer, `model`: a registry
name or a path, loaded like the target, with `quantization` of its own if given) and "mtp" (the target's own
multi-token prediction layer: DeepSeek-V3 with `num_nextn_predict_layers` >= 1; vLLM's "deepseek_mtp" and
"qwen3_next_mtp" are read as "mtp"; Qwen3-Next/Qwen3.5 targets are refused by name, `mtp_target`) and "eagle3" (an
EAGLE-3 head over the target's hidden states, `model`: its Hugging Face directory, `eagle3_config`). As in vLLM,
a `model` given without a `method` means "draft_model".

The command line's JSON text and `LLM(speculative_config={...})`'s dict are read by `SpeculativeConfig.parse`;
`EngineConfig.speculative_config` holds the result (None: speculation off)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

DEFAULT_LOOKUP = 5  # vLLM's default n-gram size when neither bound is given
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
METHODS = ("ngram", "draft_model", "mtp", "eagle3")  # served today
WITH_MODEL = ("draft_model", "eagle3")  # the methods whose drafts come from `model`
# The methods whose sampled drafts are drawn from a distribution q, which verification needs (rejection sampling).
DRAWN_METHODS = ("draft_model", "mtp", "eagle3")
ALIASES = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp"}  # vLLM's other names of a method served


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP  # n-gram sizes looked up in a request's tokens
    prompt_lookup_max: int = DEFAULT_LOOKUP
    model: str | None = None  # the draft model of "draft_model" (a registry name or a path)
    quantization: str | None = None  # the draft model's `--quantization` (None: the target's)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # Each step drafts the k in 0 .. num_speculative_tokens its measured cost model picks (`draft_length`);
    # false: num_speculative_tokens always (a pinned k, for benchmarks).
    adaptive_draft_length: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; use one of {', '.join(METHODS)}")
        if self.method in WITH_MODEL and not (isinstance(self.model, str) and self.model.strip()):
            what = "a registry name or a path" if self.method == "draft_model" else "the head's directory"
            raise ValueError(f'speculative method "{self.method}" needs "model": {what}')
        if self.method == "eagle3" and self.quantization is not None:
            raise ValueError(f"speculative method 'eagle3' takes no quantization, got {self.quantization!r}")
        if self.method not in WITH_MODEL and (self.model, self.quantization) != (None, None):
            raise ValueError(
                f"speculative method {self.method!r} takes no model, got model={self.model!r}"
                + (f", quantization={self.quantization!r}" if self.quantization is not None else "")
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.adaptive_draft_length, bool):
            value = self.adaptive_draft_length
            raise ValueError(f"speculative_config adaptive_draft_length must be true or false, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @property
    def drafts_drawn(self) -> bool:
        """Whether sampled drafts are drawn from a distribution q, which verification takes (rejection sampling)."""
        return self.method in DRAWN_METHODS

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's fields. `method` defaults to "draft_model" when a `model` is given, else "ngram" (an alias
        in `ALIASES` is read as its method); one n-gram bound given stands for both, as in vLLM."""
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown speculative_config fields: {sorted(unknown)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        fields = {"method": "draft_model" if value.get("model") is not None else "ngram", **value}
        fields["method"] = ALIASES.get(fields["method"], fields["method"])
        lo, hi = fields.pop("prompt_lookup_min", None), fields.pop("prompt_lookup_max", None)
        if lo is not None or hi is not None:
            fields["prompt_lookup_min"] = hi if lo is None else lo
            fields["prompt_lookup_max"] = lo if hi is None else hi
        return cls(**fields)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig | None:
        """From the command line's JSON text; empty text means off (None)."""
        if not text.strip():
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        return cls.from_dict(value)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From what a user may pass (`LLM(speculative_config=...)`): JSON text, a dict, or the config itself."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.from_json(value)
        return cls.from_dict(value)
