"""Sessions that lose nothing: atomic files, failed writes that change nothing, a loader that
trusts nothing on disk (stored responses' files too), no late turn in a deleted session, and
kill -9 in the middle of writes."""

from __future__ import annotations

import json
import math
import socket
import threading
import time

from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve
from server_harness import BLOCK_SIZE, KEY_A, MODEL_NAME, send, start_server

from server.state import STATE

OK_ID = "sess_" + "a" * 24


def ok(reply):
    assert reply.status == 200, reply.text
    return reply.json


def _record(session_id: str, **changes) -> dict:
    from server.auth import owner_id

    record = {
        "id": session_id,
        "owner": owner_id(KEY_A),
        "model": MODEL_NAME,
        "created_at": 1_700_000_000,
        "last_used": time.time(),
        "defaults": {},
        "messages": [{"role": "system", "content": "Be brief."}],
    }
    return {**record, **changes}


def test_a_damaged_directory_loads_what_is_sound_and_quarantines_the_rest(async_engine, tmp_path, caplog):
    good = [
        _record(OK_ID),
        _record(
            "sess_" + "b" * 24,
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "token_ids": [5, 6]},
            ],
        ),
    ]
    for record in good:
        (tmp_path / f"{record['id']}.json").write_text(json.dumps(record))
    bad = {
        "sess_" + "c" * 24: json.dumps(_record("sess_" + "c" * 24, last_used=math.nan)),  # Python writes NaN
        "sess_" + "d" * 24: json.dumps(_record("sess_" + "d" * 24))[:-40],  # truncated
        "sess_" + "e" * 24: json.dumps(_record("sess_" + "e" * 24, id="sess_" + "f" * 24)),  # id is not its name
        "sess_" + "1" * 24: json.dumps(_record("sess_" + "1" * 24, messages=[{"role": "wizard", "content": 1}])),
        "sess_" + "2" * 24: json.dumps(_record("sess_" + "2" * 24, created_at="yesterday")),
        "sess_" + "3" * 24: json.dumps(
            _record("sess_" + "3" * 24, messages=[{"role": "assistant", "content": "x", "token_ids": [10**9]}])
        ),  # not a token of this model
        "../../etc": json.dumps(_record("sess_" + "4" * 24)),
        "sess_" + "5" * 24: "[1, 2]",
    }
    for name, text in bad.items():
        (tmp_path / f"{name.replace('/', '_')}.json").write_text(text)
    (tmp_path / ".write-abc123.tmp").write_text(json.dumps(_record("sess_" + "9" * 24)))  # a write cut short
    srv = start_server(async_engine, api_keys=(KEY_A,), session_dir=tmp_path)
    try:
        listed = ok(send(srv, "GET", "/v1/sessions"))["data"]
        assert sorted(s["id"] for s in listed) == sorted(r["id"] for r in good)
        assert ok(send(srv, "GET", f"/v1/sessions/{good[1]['id']}"))["messages"][1] == {
            "role": "assistant",
            "content": "Hello",
        }  # stored token ids are not shown
        quarantined = sorted(p.name for p in (tmp_path / "quarantine").iterdir())
        assert quarantined == sorted(f"{name.replace('/', '_')}.json" for name in bad)
        assert not list(tmp_path.glob(".write-*"))
        warnings = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
        assert len(warnings) == len(bad)
        reply = send(srv, "POST", f"/v1/sessions/{OK_ID}/messages", {"content": "Hi", "max_tokens": 3})
        assert reply.status == 200  # a loaded session serves
    finally:
        srv.stop()


def test_stored_responses_load_from_their_files_and_bad_ones_are_quarantined(async_engine, tmp_path):
    rid, chain = "resp_" + "a" * 24, "resp_" + "0" * 24
    body = {"id": rid, "object": "response", "status": "completed", "output": []}
    good = _record(
        rid,
        response={"object": body, "input_items": [], "chain": chain},
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    bad = {
        "resp_" + "b" * 24: _record("resp_" + "b" * 24),  # a response id without a response
        "sess_" + "b" * 24: _record("sess_" + "b" * 24, response=good["response"]),  # a session with one
        "resp_" + "c" * 24: _record("resp_" + "c" * 24, response={"object": body}),  # no chain, no items
        "resp_" + "d" * 24: _record(
            "resp_" + "d" * 24, response=good["response"], messages=[{"role": "tool", "content": "x"}]
        ),  # a tool message without its call id
        "resp_" + "e" * 24: _record(
            "resp_" + "e" * 24, response=good["response"], messages=[{"role": "user", "content": "x", "tool_calls": []}]
        ),  # calls on a user message
    }
    (tmp_path / f"{rid}.json").write_text(json.dumps(good))
    for name, record in bad.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
    srv = start_server(async_engine, api_keys=(KEY_A,), session_dir=tmp_path)
    try:
        assert ok(send(srv, "GET", f"/v1/responses/{rid}")) == body
        assert send(srv, "GET", f"/v1/sessions/{rid}").status == 404
        assert sorted(p.stem for p in (tmp_path / "quarantine").iterdir()) == sorted(bad)
        state = srv.app[STATE]
        assert state.sessions.find(state.sessions.all()[0].owner, rid, "response").messages == good["messages"]
        srv.run(state.responses.remove(state.sessions.all()[0]))
        assert not (tmp_path / f"{rid}.json").exists()
    finally:
        srv.stop()


class _FailingDisk:
    """The store's files with writes that fail (a full or read-only disk)."""

    def __init__(self, files) -> None:
        self.files = files
        self.failing = False

    def __getattr__(self, name):
        return getattr(self.files, name)

    def save(self, record) -> None:
        if self.failing:
            raise OSError(28, "No space left on device")
        self.files.save(record)

    def delete(self, session_id) -> None:
        if self.failing:
            raise OSError(30, "Read-only file system")
        self.files.delete(session_id)


def test_failed_writes_change_nothing(async_engine, tmp_path):
    srv = start_server(async_engine, api_keys=(KEY_A,), session_dir=tmp_path, max_sessions_per_key=1)
    store = srv.app[STATE].sessions
    disk = store.files = _FailingDisk(store.files)
    try:
        disk.failing = True
        refused = send(srv, "POST", "/v1/sessions", {"system": "Be brief."})
        assert refused.status == 500 and refused.json["error"]["code"] == "session_write_failed"
        assert ok(send(srv, "GET", "/v1/sessions"))["data"] == []
        disk.failing = False
        sid = ok(send(srv, "POST", "/v1/sessions", {"system": "Be brief."}))["id"]  # the failure did not count
        before = ok(send(srv, "GET", f"/v1/sessions/{sid}"))["messages"]

        disk.failing = True
        edit = send(srv, "PUT", f"/v1/sessions/{sid}/messages/0", {"role": "system", "content": "Be long."})
        assert edit.status == 500
        turn = send(srv, "POST", f"/v1/sessions/{sid}/messages", {"content": "Hi", "max_tokens": 3})
        assert turn.status == 200  # the reply was generated, but it could not be kept
        assert send(srv, "DELETE", f"/v1/sessions/{sid}").status == 500
        assert ok(send(srv, "GET", f"/v1/sessions/{sid}"))["messages"] == before
        disk.failing = False
        assert json.loads((tmp_path / f"{sid}.json").read_text())["messages"] == before  # disk == memory
        ok(send(srv, "POST", f"/v1/sessions/{sid}/messages", {"content": "Hi", "max_tokens": 3}))
        assert len(ok(send(srv, "GET", f"/v1/sessions/{sid}"))["messages"]) == 3
    finally:
        srv.stop()


def test_a_session_deleted_while_a_message_body_arrives_takes_no_late_message(server, async_engine):
    sid = ok(send(server, "POST", "/v1/sessions", {"system": "Be brief."}))["id"]
    body = json.dumps({"content": "late", "max_tokens": 3}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        sock.sendall(
            f"POST /v1/sessions/{sid}/messages HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body[:5]
        )
        time.sleep(0.2)  # the handler is waiting for the body
        ok(send(server, "DELETE", f"/v1/sessions/{sid}"))
        sock.sendall(body[5:])
        reply = sock.recv(65536).decode()
    finally:
        sock.close()
    assert reply.startswith("HTTP/1.1 404") and "session_not_found" in reply
    assert send(server, "GET", f"/v1/sessions/{sid}").status == 404
    placed = server.engine_call(async_engine, lambda engine: engine.placement.session_target(sid))
    assert placed is None  # the engine holds no replica for the deleted session


def test_a_reply_that_retokenizes_differently_still_reuses_its_exact_ids(server):
    info = server.app[STATE].info
    sid = ok(send(server, "POST", "/v1/sessions", {"system": "Be brief."}))["id"]
    first = ok(
        send(
            server,
            "POST",
            f"/v1/sessions/{sid}/messages",
            {"content": "Hi", "max_tokens": 120, "ignore_eos": True, "temperature": 1.0, "seed": 3},
        )
    )
    text = first["choices"][0]["message"]["content"]
    generated = first["usage"]["completion_tokens"]
    assert len(info.tokenizer.encode(text)) != generated  # random tokens: the text spells differently
    second = ok(send(server, "POST", f"/v1/sessions/{sid}/messages", {"content": "More", "max_tokens": 2}))
    history = first["usage"]["prompt_tokens"] + generated
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= (history - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second["usage"]["prompt_tokens"] < history + 20  # the new message and the template only
    ok(send(server, "DELETE", f"/v1/sessions/{sid}"))


def _write_loop(port: int, sid: str, acked: dict[str, int], stop: threading.Event) -> None:
    """Edit the session's system message to version k = 1, 2, ... until the server dies;
    acked[sid] is the last version the server confirmed."""
    k = 0
    while not stop.is_set():
        k += 1
        try:
            reply = send(
                _Port(port),
                "PUT",
                f"/v1/sessions/{sid}/messages/0",
                {"role": "system", "content": f"v{k} " + "x" * 50_000},
                key="k1",
                timeout=10,
            )
        except OSError:
            return
        if reply.status != 200:
            return
        acked[sid] = k


class _Port:
    def __init__(self, port: int) -> None:
        self.port = port


def _serve(port: int, session_dir) -> ChildProcess:
    return ChildProcess(
        jaxserve(
            "serve",
            "--model",
            MODEL_NAME,
            "--port",
            str(port),
            "--api-key",
            "k1",
            "--session-dir",
            str(session_dir),
            *SMALL_ENGINE,
        )
    )


def test_kill_9_during_session_writes_leaves_each_session_at_its_previous_or_new_state(tmp_path):
    port = free_port()
    with _serve(port, tmp_path) as child:
        child.wait_for("Running on", timeout=240)
        sids = [send(_Port(port), "POST", "/v1/sessions", {"system": "v0"}, key="k1").json["id"] for _ in range(4)]
        acked = dict.fromkeys(sids, 0)
        stop = threading.Event()
        writers = [threading.Thread(target=_write_loop, args=(port, sid, acked, stop)) for sid in sids]
        for w in writers:
            w.start()
        deadline = time.monotonic() + 120  # the writes must be under way, however slow the machine
        while min(acked.values()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # and in the middle of one
        child.proc.kill()  # SIGKILL: no handler runs
        child.proc.wait()
        stop.set()
        for w in writers:
            w.join(30)
    assert min(acked.values()) >= 3, acked  # the writes were really under way
    with _serve(port, tmp_path) as child:
        child.wait_for("Running on", timeout=240)
        assert not (tmp_path / "quarantine").exists(), child.output
        for sid in sids:
            content = ok(send(_Port(port), "GET", f"/v1/sessions/{sid}", key="k1"))["messages"][0]["content"]
            version = int(content.split(" ", 1)[0][1:])
            assert version in (acked[sid], acked[sid] + 1), (version, acked[sid])
            assert content == f"v{version} " + "x" * 50_000
        child.terminate()
        assert child.finish(60) == 0
