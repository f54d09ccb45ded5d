"""Images through `jaxserve router` over real worker processes serving the tiny Gemma 3 vision-language
model (loopback gRPC; its weights written as a Hugging Face directory): a chat with images (the official
`openai` client) reaches its worker with them and replies transformers' greedy tokens
(tests/data/vlm_reference.json, as the engine served directly does); placement keys a prompt by its
images' digests (the same text with another image is not the same prefix); a session's turns keep
their image and pin its blocks on their worker; a stream whose worker dies has it resumed on the
other with its images; a prefill/decode split hands over the KV of the image's blocks and replies
as colocated. After each test every worker's KV pool is free."""

from __future__ import annotations

import io
import time

import grpc
import jax
import numpy as np
import openai
import pytest
from child_process import SMALL_ENGINE, free_port
from PIL import Image
from router_cluster import Endpoint, load, routed, start_router, start_worker, wait_idle
from server_harness import KEY_A, MODEL_NAME, send
from test_server_images import REFERENCE, data_url, user_message

from checkpoints.hf import save_hf_dir
from checkpoints.tiny_vlm import build_tiny_vlm
from jaxserve.image_prompt import PromptImage
from jaxserve.images import load_image
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import images_to_messages, params_to_json
from server.cluster.worker.worker_pb2_grpc import WorkerStub
from tests.data.vlm_images import image_png

LEASE_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def cluster(_compilation_cache, tmp_path_factory):
    model = build_tiny_vlm()
    directory = tmp_path_factory.mktemp("tiny_vlm") / MODEL_NAME  # served under its directory's name
    directory.mkdir()
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, directory, vision=model.vision)
    cache_dir = jax.config.jax_compilation_cache_dir
    roles = {"a": [], "b": [], "prefill": ["--role", "prefill", "--kv-lease-timeout", str(LEASE_TIMEOUT)]}
    roles["decode"] = ["--role", "decode"]
    ports = {name: free_port() for name in roles}
    procs = {"a": start_worker(ports["a"], SMALL_ENGINE, cache_dir, model=str(directory))}
    procs["a"].wait_for("worker listening", timeout=900)  # the others find its programs in the cache
    for name in ("b", "prefill", "decode"):
        procs[name] = start_worker(ports[name], [*SMALL_ENGINE, *roles[name]], cache_dir, model=str(directory))
    for name in ("b", "prefill", "decode"):
        procs[name].wait_for("worker listening", timeout=900)
    colo_router, colo = start_router([ports["a"], ports["b"]], "--api-key", KEY_A)
    split_args = ["--prefill-worker", f"127.0.0.1:{ports['prefill']}", "--decode-worker"]
    split_router, split = start_router([], *split_args, f"127.0.0.1:{ports['decode']}", "--api-key", KEY_A)
    colo_router.wait_for("Running on", timeout=120)
    split_router.wait_for("Running on", timeout=120)
    yield dict(ports=ports, procs=procs, colo=colo, split=split, engine=model)
    routers = [colo_router, split_router]
    for proc in [*routers, *procs.values()]:
        if proc.proc.poll() is None:
            proc.terminate()
    for proc in [*routers, *procs.values()]:
        proc.finish(60)
    output = "\n".join(p.output for p in routers)
    assert "Traceback" not in output, output


@pytest.fixture(autouse=True)
def pools_free_after(cluster):
    yield
    for name, port in cluster["ports"].items():
        if cluster["procs"][name].proc.poll() is not None:
            continue  # killed by the test
        snap = wait_idle(port)
        assert snap.kv.used == 0 and snap.kv.pinned == 0 and not snap.has_unfinished, (name, snap.kv)


def client(router: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)


def chat(router: Endpoint, case: dict, max_tokens: int | None = None, **kw):
    n = len(case["new_ids"]) if max_tokens is None else max_tokens
    return client(router).chat.completions.create(
        model=MODEL_NAME, messages=user_message(case), max_tokens=n, temperature=0.0, **kw
    )


def expected(cluster, case: dict, n: int | None = None) -> str:
    ids = case["new_ids"] if n is None else case["new_ids"][:n]
    return Tokenizer(cluster["engine"].tokenizer_bundle).decode(ids)


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_chat_with_images_through_the_router_replies_transformers_tokens(cluster, name):
    """Through the split router, the decode worker finds the prompt's blocks (its image's rows
    included) in its cache: pulled from the prefill worker, keyed by the image's digest on both."""
    case, decode_port = REFERENCE[name], cluster["ports"]["decode"]
    hits = load(decode_port).prefix_hit_tokens
    for router in (cluster["colo"], cluster["split"]):
        out = chat(router, case)
        assert out.choices[0].message.content == expected(cluster, case), router.base_url
        assert out.usage.prompt_tokens == len(case["prompt_ids"])
    assert load(decode_port).prefix_hit_tokens - hits >= len(case["prompt_ids"]) // 8 * 8


def noise_chat(router: Endpoint, seed: int):
    """A chat about a random picture (seed `seed`, new to every worker) with one_image's text."""
    pixels = np.random.default_rng(seed).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(png, format="PNG")
    messages = user_message(REFERENCE["one_image"], lambda _: data_url(png.getvalue()))
    return client(router).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0.0)


def test_placement_keys_a_prompt_by_its_images(cluster):
    """With worker a busy, a chat about picture X goes to worker b. Then (loads equal) the same text
    with picture Y is not b's cached prefix (only the text before the image is, too little to count)
    and goes to a, the first of equals; X again goes to b, which holds its blocks."""
    colo = cluster["colo"]
    busy = client(colo).completions.create(
        model=MODEL_NAME, prompt="Busy " * 8, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(busy))  # a runs it now
    before = routed(colo)
    x = noise_chat(colo, 1)
    after_x = routed(colo)
    for _ in busy:  # let it end: both workers idle again
        pass
    assert [n - m for n, m in zip(after_x, before)] == [0, 1]
    y = noise_chat(colo, 2)
    after_y = routed(colo)
    assert [n - m for n, m in zip(after_y, after_x)] == [1, 0]
    again = noise_chat(colo, 1)
    assert [n - m for n, m in zip(routed(colo), after_y)] == [0, 1]
    assert again.choices[0].message.content == x.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 25  # the image's rows are 9-24
    assert y.usage.prompt_tokens_details.cached_tokens <= 9


def test_a_session_with_an_image_through_the_router(cluster):
    colo, case = cluster["colo"], REFERENCE["one_image"]
    message = user_message(case)[0]
    sid = send(colo, "POST", "/v1/sessions", {"temperature": 0, "max_tokens": 4}).json["id"]
    first = send(colo, "POST", f"/v1/sessions/{sid}/messages", {"content": message["content"]}).json
    assert first["choices"][0]["message"]["content"] == expected(cluster, case, 4)
    deadline = time.monotonic() + 30
    pinned = lambda: sum(load(port).kv.pinned for port in (cluster["ports"]["a"], cluster["ports"]["b"]))  # noqa: E731
    while pinned() < 25 // 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pinned() >= 25 // 8  # the pin holds the image's blocks, keyed by its digest
    second = send(colo, "POST", f"/v1/sessions/{sid}/messages", {"content": "And the colours?"}).json
    history = [message, {"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    history.append({"role": "user", "content": "And the colours?"})
    whole = client(colo).chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=4, temperature=0.0)
    assert second["choices"][0]["message"]["content"] == whole.choices[0].message.content
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 25
    assert send(colo, "DELETE", f"/v1/sessions/{sid}").status == 200
    deadline = time.monotonic() + 30
    while pinned() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_worker_refuses_images_that_do_not_fit_the_prompt(cluster):
    """A request's images are checked against the model and the prompt: rows not on image tokens,
    pixels whose digest is not theirs."""
    case = REFERENCE["one_image"]
    image = load_image(image_png("red"), 32, 10**6)
    row = images_to_messages([PromptImage(9, 16, image)])[0]
    params = params_to_json(SamplingParams(max_tokens=2, temperature=0.0))
    bad = {
        "its rows [8, 24) are not its image tokens": pb.PromptImage(**{**_fields(row), "start": 8}),
        "its digest is not its pixels'": pb.PromptImage(**{**_fields(row), "digest": bytes(16)}),
    }
    with grpc.insecure_channel(f"127.0.0.1:{cluster['ports']['a']}") as channel:
        stub = WorkerStub(channel)
        for message, image_msg in bad.items():
            request = pb.GenerateRequest(
                request_id=f"bad-{len(message)}", prompt_token_ids=case["prompt_ids"], sampling_params_json=params
            )
            request.images.append(image_msg)
            with pytest.raises(grpc.RpcError) as raised:
                list(stub.Generate(request, timeout=30))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in raised.value.details()
    assert np.array_equal(np.frombuffer(row.pixels, "<f4").reshape(3, 32, 32), image.pixels)


def _fields(m: pb.PromptImage) -> dict:
    return {f.name: getattr(m, f.name) for f in m.DESCRIPTOR.fields}


def test_a_stream_resumes_with_its_images_on_the_other_worker(cluster):
    """(Last: it kills a worker.) The stream's worker dies after its first tokens; the other worker
    goes on from the prompt, its images and the tokens so far (routed to it: one more request), and
    the text is that of the whole sequence on one worker."""
    colo, case = cluster["colo"], REFERENCE["two_images"]
    long = dict(max_tokens=160, extra_body={"ignore_eos": True})
    whole = chat(colo, case, **long).choices[0].message.content
    before = routed(colo)
    chunks = iter(chat(colo, case, stream=True, **long))
    text = ""
    while not text:
        text += next(chunks).choices[0].delta.content or ""
    victim = 0 if routed(colo)[0] > before[0] else 1
    cluster["procs"]["ab"[victim]].proc.kill()
    text += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert routed(colo)[1 - victim] == before[1 - victim] + 1  # the rest ran there
