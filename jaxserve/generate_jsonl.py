"""`jaxserve generate`: offline batch generation from a JSONL file to a JSONL file.

Each input line is an object with `prompt` (string or token ids) or `messages` (a chat), an
optional `id`, and optional sampling overrides with SamplingParams' names (`max_tokens`,
`temperature`, ...). Each output line carries the input's `id` (or its line number), in input
order, and is written (and flushed) as soon as it and every line before it are done. A line
already present in the output is skipped, so an interrupted run resumes where it stopped. A bad
line gets an error record and does not stop the others.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _parse_line(raw: str, defaults: dict[str, Any]) -> tuple[str | list[int], SamplingParams]:
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    unknown = set(obj) - _PARAM_FIELDS - {"id", "prompt", "messages"}
    if unknown:
        raise ValueError(f"unknown fields: {sorted(unknown)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError("a line needs exactly one of 'prompt' or 'messages'")
    params = SamplingParams(**{**defaults, **{k: v for k, v in obj.items() if k in _PARAM_FIELDS}})
    if "messages" in obj:
        messages = obj["messages"]
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise ValueError("'messages' must be a non-empty list of {role, content} strings")
        return messages, params
    prompt = obj["prompt"]
    if isinstance(prompt, str) and prompt:
        return prompt, params
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt, params
    raise ValueError("'prompt' must be a non-empty string or list of token ids")


def _done_ids(output_path: Path) -> set[str]:
    """The ids already written to `output_path` (a resumed run skips them)."""
    done: set[str] = set()
    if output_path.exists():
        for line in output_path.read_text().splitlines():
            try:
                done.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                continue
    return done


def _read_jobs(
    llm: LLM, input_path: Path, done: set[str], defaults: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[tuple[int, list[int], SamplingParams]]]:
    """A record per line not done (with its error, if the line is bad) and the jobs of the good
    lines: (record index, prompt ids, sampling parameters)."""
    records: list[dict[str, Any]] = []
    jobs: list[tuple[int, str | list[int], SamplingParams]] = []
    tokenizer = llm.get_tokenizer()
    for lineno, raw in enumerate(input_path.read_text().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line_id = str(json.loads(raw).get("id", lineno))
        except (ValueError, AttributeError):
            line_id = str(lineno)
        if line_id in done:
            continue
        records.append({"id": line_id})
        try:
            prompt, params = _parse_line(raw, defaults)
            if isinstance(prompt, list) and isinstance(prompt[0], dict):
                prompt = tokenizer.encode(tokenizer.apply_chat_template(prompt, add_generation_prompt=True))
            jobs.append((len(records) - 1, prompt, params))
        except (ValueError, TypeError) as e:
            records[-1]["error"] = str(e)
    good = []
    for idx, prompt, params in jobs:
        try:  # the engine's own checks (context length, token range) before batching
            good.append((idx, llm.engine.encode_prompt(prompt), params))
        except ValueError as e:
            records[idx]["error"] = str(e)
    return records, good


def run(llm: LLM, input_path: Path, output_path: Path, defaults: dict[str, Any]) -> dict[str, int]:
    """Generate every line of `input_path` not yet in `output_path`; return counts."""
    done = _done_ids(output_path)
    records, good = _read_jobs(llm, input_path, done, defaults)
    waiting = {idx for idx, _, _ in good}
    written = 0
    with output_path.open("a") as f:

        def write_ready() -> None:  # the finished records before the first unfinished one
            nonlocal written
            while written < len(records) and written not in waiting:
                f.write(json.dumps(records[written], ensure_ascii=False) + "\n")
                written += 1
            f.flush()

        write_ready()
        finished = llm.generate_as_completed([ids for _, ids, _ in good], [p for _, _, p in good]) if good else []
        for position, out in finished:
            idx = good[position][0]
            records[idx]["outputs"] = [
                {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason} for o in out.outputs
            ]
            records[idx]["usage"] = {
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": sum(len(o.token_ids) for o in out.outputs),
            }
            waiting.discard(idx)
            write_ready()
    errors = sum(1 for r in records if "error" in r)
    return {"generated": len(records) - errors, "errors": errors, "skipped": len(done)}
