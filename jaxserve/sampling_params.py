"""How one request wants its tokens chosen, with vLLM's field names (no JAX here).

Validation happens once, at construction: every later layer (scheduler, sampler, server)
may trust the values. All failures raise `ValueError` naming the field, so the server can
turn them into a 400 response. The ranges are what the engine's arrays can hold (int32 rows,
float32 rows) and what keeps one request from slowing the step of every other: stop strings
are checked against the text on every token of every choice, so their count and length are
capped. Checks that need the model (token ids below the vocabulary size) are in
`check_vocabulary`, which the server and the engine call once they know the model.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from jaxserve.structured.spec import GuidedDecoding

MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask for (OpenAI's limit)
MAX_LOGIT_BIAS = 300  # the most tokens a request may bias (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0  # each bias is in [-100, 100] (OpenAI's range)
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 64  # characters in one stop string
MAX_STOP_TOTAL_CHARS = 128  # characters in all of a request's stop strings together
INT32_MAX = 2**31 - 1  # token ids, counts and top_k live in int32 rows
FLOAT32_MAX = 3.4028234663852886e38
MIN_TEMPERATURE = 1e-2  # vLLM's floor: lower non-zero temperatures overflow float32 logits; raised to it
REPETITION_PENALTY_RANGE = (1e-3, 1e3)  # logits are divided by it in float32
SEED_RANGE = (-(2**63), 2**64)  # a seed fits in 64 bits, signed or not
POOLING_KINDS = ("last", "mean", "cls")  # `SamplingParams.pooling`: `jaxserve.pooling.POOLERS`


def encodes_as_utf8(text: str) -> bool:
    """Whether `text` is valid Unicode (no lone surrogates, which JSON's \\ud800 escapes can make)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass
class SamplingParams:
    """Sampling settings of one request (vLLM's names and defaults).

        `top_k` 0 or -1 means "off" (stored as 0). `temperature` 0 means greedy. `logprobs` None
        returns no log-probabilities, 0 only the sampled token's, k (<= 20) also the k most
        likely tokens'. `prompt_logprobs` (vLLM's) likewise for every prompt token after the
        first: its log-probability given the tokens before it, and the k most likely there. `seed` None
    lets the engine draw a seed for the request once, so its
        random stream is still fixed for its whole life (including preemption and recompute).
        `logit_bias` maps token ids to values added to their logits before sampling (OpenAI's
        semantics: -100 bans a token, +100 all but forces it); log-probabilities stay unbiased.
        `min_tokens` (vLLM's): until that many tokens are out, EOS and `stop_token_ids` cannot be
        sampled and stop strings are not looked for. `include_stop_str_in_output` (vLLM's) keeps
        the stop string that ended the text at its end. `guided` constrains the output to a JSON
        schema, regex, choice or grammar (structured output; see `jaxserve.structured`).
        `pooling` ("last" or "mean") makes the request an embedding: its prompt is prefilled and
        nothing is generated; the final delta carries the pooled final hidden states of the prompt
        (after the model's final norm, not normalized), `Delta.embedding`. Build it with `for_pooling`.
        `lora` names the LoRA adapter to run the request with (None: the base model); it travels with
        the other settings so that every engine (replica, remote worker) sees it.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = dataclasses.field(default_factory=list)
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    guided: GuidedDecoding | None = None
    pooling: str | None = None
    lora: str | None = None

    @classmethod
    def for_pooling(cls, kind: str) -> SamplingParams:
        """An embedding request: `kind` pooling of the prompt's hidden states, nothing generated
        (the engine samples the one token its prefill step samples anyway, and drops it)."""
        return cls(max_tokens=1, temperature=0.0, pooling=kind)

    def __post_init__(self) -> None:
        self._check_ints()
        self._check_floats()
        self.logit_bias = self._checked_logit_bias(self.logit_bias)
        self.stop = self._checked_stop(self.stop)
        self.stop_token_ids = self._checked_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise ValueError(f"guided must be a GuidedDecoding, got {self.guided!r}")
        self._check_pooling()
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora must be a non-empty adapter name, got {self.lora!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def _check_ints(self) -> None:
        for name in ("n", "max_tokens", "min_tokens", "top_k", "priority"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name} must be an integer or None, got {value!r}")
        for name in ("n", "max_tokens", "min_tokens", "top_k", "priority"):
            if not -INT32_MAX - 1 <= getattr(self, name) <= INT32_MAX:
                raise ValueError(f"{name} must fit in 32 bits, got {getattr(self, name)}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or at least 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    def _check_floats(self) -> None:
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise ValueError(f"{name} must be a finite 32-bit float, got {value!r}")
            setattr(self, name, float(value))
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}")

    def _check_pooling(self) -> None:
        if self.pooling is None:
            return
        if self.pooling not in POOLING_KINDS:
            raise ValueError(f"pooling must be one of {list(POOLING_KINDS)}, got {self.pooling!r}")
        if (
            (self.n, self.max_tokens) != (1, 1)
            or self.guided is not None
            or self.logprobs is not None
            or self.prompt_logprobs is not None
        ):
            raise ValueError(
                "a pooling request generates nothing: n and max_tokens must be 1, and it takes no "
                "guided, logprobs or prompt_logprobs"
            )

    def check_vocabulary(self, vocab_size: int) -> None:
        """The token ids this request names (stop tokens, biased tokens) exist in a vocabulary of
        `vocab_size`; else ValueError naming the field."""
        if any(i >= vocab_size for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")

    @staticmethod
    def _checked_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop cannot contain an empty string")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if max(map(len, stop), default=0) > MAX_STOP_STRING_CHARS or sum(map(len, stop)) > MAX_STOP_TOTAL_CHARS:
            raise ValueError(
                f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters each and "
                f"{MAX_STOP_TOTAL_CHARS} together"
            )
        if not all(map(encodes_as_utf8, stop)):
            raise ValueError("stop strings must be valid Unicode (no lone surrogates)")
        return list(stop)

    @staticmethod
    def _checked_logit_bias(bias: object) -> dict[int, float] | None:
        if bias is None or bias == {}:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a mapping of token ids to numbers, got {bias!r}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        checked = {}
        for token, value in bias.items():
            if not _is_int(token) or not 0 <= token <= INT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids (non-negative 32-bit integers), got {token!r}")
            if not _is_real(value) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r}")
            checked[int(token)] = float(value)
        return checked

    @staticmethod
    def _checked_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and 0 <= i <= INT32_MAX for i in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (non-negative 32-bit integers), got {ids!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        return [int(i) for i in ids]
