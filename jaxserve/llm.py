"""Offline batch generation, with vLLM's names: `LLM(model=...).generate(prompts, params)`, and
embeddings: `LLM(...).embed(prompts)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from checkpoints.registry import DEFAULT_MODEL
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import make_engine
from jaxserve.image_prompt import MultimodalPrompt
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.speculative.config import SpeculativeConfig

PromptType = str | list[int] | dict[str, Any] | MultimodalPrompt  # a chat with images: `jaxserve.image_prompt`


class LLM:
    """Offline engine. Keyword arguments are `EngineConfig` fields (max_num_seqs, dtype, ...)."""

    def __init__(self, model: str = DEFAULT_MODEL, warm_up: bool = True, **engine_args: Any):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = set(engine_args) - fields
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        # vLLM's speculative_config: a dict (or JSON text) here, one SpeculativeConfig in the engine config.
        speculative = SpeculativeConfig.parse(engine_args.pop("speculative_config", None))
        self.engine = make_engine(model, EngineConfig(**engine_args, speculative_config=speculative))
        self.warm_up_seconds = self.engine.warm_up() if warm_up else 0.0
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Write what the KV disk tier (`kv_disk_dir`) lacks of the prefix cache and stop its threads,
        so the next engine on the directory finds it; nothing to do without a disk tier."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, token ids, or {"prompt_token_ids": [...]});
        results come back in input order."""
        prompts, params_list = self._normalize(prompts, sampling_params)
        results: list[RequestOutput] = [None] * len(prompts)  # type: ignore[list-item]
        for index, output in self._finished([_as_prompt(p) for p in prompts], params_list, use_tqdm):
            results[index] = output
        return results

    def embed(
        self, prompts: PromptType | Sequence[PromptType], pooling: str = "last", use_tqdm: bool = True
    ) -> list[np.ndarray]:
        """Each prompt's pooled final hidden states (`SamplingParams.pooling`: "last" or "mean"),
        float32 and not normalized, in input order; nothing is generated."""
        outputs = self.generate(prompts, SamplingParams.for_pooling(pooling), use_tqdm)
        return [out.embedding for out in outputs]

    @staticmethod
    def _normalize(
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> tuple[list[PromptType], list[SamplingParams]]:
        """Prompts as a list, and one SamplingParams per prompt."""
        one = isinstance(prompts, (str, dict, MultimodalPrompt))
        if one or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        return prompts, params_list

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        # Ids, not text: the template writes its own special tokens (a BOS is not added again).
        prompts = [
            tok.encode(tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt)) for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate_as_completed(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Like `generate`, but yields (input index, output) as each request finishes, so a
        caller can save results while the rest run. Closing the iterator early aborts the rest."""
        prompts, params_list = self._normalize(prompts, sampling_params)
        return self._finished([_as_prompt(p) for p in prompts], params_list, use_tqdm)

    def _finished(
        self, prompts: list[str | list[int] | MultimodalPrompt], params_list: list[SamplingParams], use_tqdm: bool
    ) -> Iterator[tuple[int, RequestOutput]]:
        engine = self.engine
        outputs: dict[str, RequestOutput] = {}
        index_of: dict[str, int] = {}
        for prompt, params in zip(prompts, params_list):
            rid = f"offline-{next(self._ids)}"
            group = engine.add_request(rid, prompt, params)
            index_of[rid] = len(index_of)
            outputs[rid] = RequestOutput(
                request_id=rid,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=group[0].prompt_token_ids,
                outputs=[
                    CompletionOutput(i, "", [], None, [] if params.logprobs is not None else None)
                    for i in range(params.n)
                ],
                finished=False,
            )
        bar = tqdm(total=len(index_of), desc="generating", disable=not use_tqdm, unit="req")
        remaining = {rid: len(out.outputs) for rid, out in outputs.items()}
        try:
            while engine.has_unfinished_requests():
                for d in engine.step():
                    rid = d.request_id
                    out = outputs[rid].outputs[d.index]
                    out.text += d.text
                    out.token_ids.extend(d.token_ids)
                    if out.logprobs is not None and d.logprobs:
                        out.logprobs.extend(d.logprobs)
                    if d.prompt_logprobs is not None:
                        outputs[rid].prompt_logprobs = d.prompt_logprobs
                    if d.finished:
                        out.finish_reason = d.finish_reason
                        outputs[rid].embedding = d.embedding
                        outputs[rid].num_cached_tokens = max(outputs[rid].num_cached_tokens, d.usage.cached_tokens)
                        remaining[rid] -= 1
                        if remaining[rid] == 0:
                            outputs[rid].finished = True
                            bar.update(1)
                            yield index_of[rid], outputs[rid]
        finally:
            for rid, out in outputs.items():
                if not out.finished:
                    engine.abort(rid)
            bar.close()


def _as_prompt(p: PromptType) -> str | list[int] | MultimodalPrompt:
    if isinstance(p, MultimodalPrompt):
        return p
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return list(p["prompt_token_ids"])
        if "prompt" in p:
            return p["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(p, str):
        return p
    if isinstance(p, Iterable):
        return list(p)
    raise TypeError(f"unsupported prompt type {type(p).__name__}")
