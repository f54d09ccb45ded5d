"""`jaxserve serve --model all-minilm-l6-v2`: the registry name fetches the encoder, warm-up
compiles its (rows x tokens) buckets, and `/v1/embeddings` serves it."""

from __future__ import annotations

import numpy as np
from child_process import ChildProcess, free_port, jaxserve
from server_harness import send


class _Port:
    def __init__(self, port: int) -> None:
        self.port = port


def test_serve_an_encoder_by_its_registry_name():
    port = free_port()
    small = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "64"]
    with ChildProcess(jaxserve("serve", "--model", "all-minilm-l6-v2", "--port", str(port), *small)) as child:
        child.wait_for("Running on", timeout=300)
        assert "encoder shapes (rows x tokens): 1x16, 2x16, 4x16, 1x24, 2x24, 1x32, 2x32, 1x48, 1x64" in child.output
        srv = _Port(port)
        body = {"model": "all-minilm-l6-v2", "input": ["a cat", "a dog"]}
        reply = send(srv, "POST", "/v1/embeddings", body, key=None)
        assert reply.status == 200, reply.text
        vectors = [np.asarray(d["embedding"]) for d in reply.json["data"]]
        assert [len(v) for v in vectors] == [384, 384]
        np.testing.assert_allclose([np.linalg.norm(v) for v in vectors], 1.0, rtol=1e-5)
        chat = send(srv, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, key=None)
        assert chat.status == 400 and chat.json["error"]["code"] == "model_not_generative"
        child.terminate()
        assert child.finish(60) == 0
        assert "Traceback" not in child.output, child.output
