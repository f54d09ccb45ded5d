"""One sequence generated on a worker, as the router turns its tokens into deltas.

The worker samples and applies the stop rules that need no text (stop token ids, EOS,
max_tokens, the context); the router detokenizes and looks for stop strings, in the order
`LLMEngine._update` applies them: a stop token's text is never added, stop strings are not
looked for before `min_tokens` tokens, and a stop string ends the sequence before a length
limit reached by the same token. So a router's deltas equal those of one process.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.outputs import Delta, FinishReason, SampledToken, Usage
from jaxserve.sampling_params import SamplingParams
from jaxserve.text_stream import TextStream
from jaxserve.tokenizer import Tokenizer
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import logprobs_from_message


def worker_params(params: SamplingParams, seed: int | None) -> SamplingParams:
    """What a worker is asked for: one sequence with this seed, stop strings kept by the router."""
    return dataclasses.replace(params, n=1, seed=seed, stop=[])


class RemoteSequence:
    def __init__(
        self, group_id: str, index: int, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer
    ) -> None:
        self.params = params
        self.num_out = 0
        self.token_ids: list[int] = []  # sampled so far
        self.stopped = False  # a stop string ended the text
        self.num_prompt = len(prompt_ids)
        self._stream = TextStream(group_id, index, params, prompt_ids, tokenizer)
        eos = () if params.ignore_eos else tokenizer.eos_token_ids
        self._stop_token_ids = frozenset((*params.stop_token_ids, *eos))

    def feed(self, msg: pb.GenerateResponse) -> bool:
        """Take a worker message's tokens; True when a stop string has ended the text (the rest
        of the message is dropped, and the worker's request must be aborted)."""
        logprobs = logprobs_from_message(msg)
        last = len(msg.token_ids) - 1
        for j, token in enumerate(msg.token_ids):
            self.num_out += 1
            self.token_ids.append(token)
            lp = logprobs[j] if j < len(logprobs) else None
            top = lp.top if lp is not None else []
            self._stream.add_token(
                SampledToken(
                    token,
                    lp.logprob if lp is not None else 0.0,
                    np.array([i for i, _ in top], np.int32),
                    np.array([p for _, p in top], np.float32),
                )
            )
            if j == last and msg.finish_reason == FinishReason.STOP.value and token in self._stop_token_ids:
                break  # the worker stopped on a stop token id or EOS, whose text the engine never adds
            # (a sequence whose grammar is complete also stops, on a token whose text counts)
            if self._stream.add_text(token, check_stops=self.num_out >= self.params.min_tokens):
                self.stopped = True
                return True
        return False

    def delta(self, finish_reason: str | None, usage: Usage | None) -> Delta | None:
        """The output since the last delta (None when there is nothing new and it is not the end)."""
        reason = FinishReason(finish_reason) if finish_reason else None
        return self._stream.take_delta(reason, usage)

    def stop_usage(self, cached_tokens: int) -> Usage:
        """Usage of a sequence the router ended at a stop string."""
        return Usage(self.num_prompt, self.num_out, cached_tokens)
