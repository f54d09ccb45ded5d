"""Parts of the Responses API that need no server: which messages `truncation: "auto"` drops."""

from __future__ import annotations

from server.response_prompt import _without_oldest

SYSTEM = {"role": "system", "content": "Be brief."}
CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_truncation_keeps_system_messages_and_drops_the_results_of_dropped_calls():
    user = [{"role": "user", "content": f"q{i}"} for i in range(3)]
    messages = [SYSTEM, user[0], CALL, RESULT, user[1], {"role": "system", "content": "Later."}, user[2]]
    assert _without_oldest(messages, 0) == messages
    assert _without_oldest(messages, 1) == [SYSTEM, CALL, RESULT, user[1], messages[5], user[2]]
    assert _without_oldest(messages, 2) == [SYSTEM, user[1], messages[5], user[2]]  # the call's result goes too
    assert _without_oldest(messages, 3) == [SYSTEM, messages[5], user[2]]
