#!/usr/bin/env python3
"""The official `anthropic` Python client against prefixlb in front of mock engines.

    python3 tests/clients/anthropic_check.py target/debug/prefixlb

Starts four engines and the balancer itself (loopback, ports chosen by the OS), then
checks what a user of the client sees on Anthropic's Messages API: messages.create
with and without streaming, a multi-turn conversation whose turns all land on one
engine (and find their history cached there), a streamed tool_use, count_tokens, and
that our errors become the client's exceptions (401 -> AuthenticationError, 404 ->
NotFoundError, 503 on saturation -> APIStatusError, each with Anthropic's error type).
Exits non-zero on the first failure.
"""

import threading

import anthropic

from harness import balancer, check, engines, run

KEY = "sk-ant-check"


def main():
    lb = balancer(engines(4), "ANTHROPIC_CHECK_KEYS", KEY)
    # The client sends the key as `x-api-key`, as it does to Anthropic.
    client = anthropic.Anthropic(base_url=f"http://{lb}", api_key=KEY, max_retries=0, timeout=20)

    r = client.messages.create(model="mock", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    check("messages.create", r.type == "message" and r.content[0].text.strip() != ""
          and r.usage.input_tokens > 0 and r.stop_reason == "max_tokens", r)

    text, final = "", None
    with client.messages.stream(model="mock", max_tokens=4, messages=[{"role": "user", "content": "hi"}]) as s:
        for t in s.text_stream:
            text += t
        final = s.get_final_message()
    check("messages.stream", len(text.split()) == 4 and final.usage.output_tokens == 4, (text, final))

    events = [e.type for e in client.messages.create(model="mock", max_tokens=2, stream=True,
                                                     messages=[{"role": "user", "content": "hi"}])]
    check("messages.create(stream=True)", events[0] == "message_start" and events[-1] == "message_stop"
          and "content_block_delta" in events, events)

    # A coding agent's turns: a long system prompt with a cache marker that moves to the
    # newest block each turn. Every turn goes to one engine and finds its history there.
    system = [{"type": "text", "text": "You are a coding agent. " + "Follow the rules. " * 300,
               "cache_control": {"type": "ephemeral"}}]
    history, served, cached = [], set(), []
    for turn in range(4):
        history.append({"role": "user", "content": [{"type": "text", "text": f"step {turn}: " + "look at main.rs " * 40}]})
        for m in history:
            for b in m["content"]:
                b.pop("cache_control", None)
        history[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        raw = client.messages.with_raw_response.create(model="mock", max_tokens=8, system=system, messages=history)
        served.add(raw.headers.get("x-prefixlb-node"))
        r = raw.parse()
        cached.append(r.usage.cache_read_input_tokens)
        history.append({"role": "assistant", "content": [{"type": "text", "text": r.content[0].text}]})
    check("a multi-turn conversation stays on one engine", len(served) == 1 and all(c > 0 for c in cached[1:]),
          (served, cached))

    tools = [{"name": "lookup", "description": "look up", "input_schema": {"type": "object"}}]
    with client.messages.stream(model="mock", max_tokens=16, tools=tools,
                                messages=[{"role": "user", "content": "x"}]) as s:
        final = s.get_final_message()
    block = final.content[0]
    check("a streamed tool_use", block.type == "tool_use" and block.name == "lookup" and block.input == {"x": 1}
          and final.stop_reason == "tool_use", final)

    n = client.messages.count_tokens(model="mock", messages=[{"role": "user", "content": "count these words"}])
    check("messages.count_tokens", n.input_tokens > 0, n)

    try:
        client.messages.create(model="no-such-model", max_tokens=1, messages=[{"role": "user", "content": "x"}])
        check("404 -> NotFoundError", False, "no exception")
    except anthropic.NotFoundError as err:
        check("404 -> NotFoundError", err.status_code == 404 and "no-such-model" in str(err)
              and err.body["error"]["type"] == "not_found_error", err)

    try:
        anthropic.Anthropic(base_url=f"http://{lb}", api_key="sk-wrong", max_retries=0).messages.create(
            model="mock", max_tokens=1, messages=[{"role": "user", "content": "x"}])
        check("401 -> AuthenticationError", False, "no exception")
    except anthropic.AuthenticationError as err:
        check("401 -> AuthenticationError", err.status_code == 401
              and err.body["error"]["type"] == "authentication_error", err)

    # Saturation: every node (cap 1 each) busy with a long stream; the next is refused.
    started = threading.Barrier(5)

    def hold(session):
        s = client.messages.create(model="mock", max_tokens=400, stream=True,
                                   messages=[{"role": "user", "content": session}],
                                   extra_headers={"x-session-id": session})
        first = True
        for e in s:
            if first and e.type == "content_block_delta":
                started.wait()
                first = False

    # Spread the holders over the four nodes by their keys (one per node).
    holders = [threading.Thread(target=hold, args=(f"hold-{i}",)) for i in range(4)]
    for t in holders:
        t.start()
    started.wait()
    try:
        client.messages.create(model="mock", max_tokens=1, messages=[{"role": "user", "content": "one more"}])
        check("503 -> APIStatusError", False, "no exception")
    except anthropic.APIStatusError as err:
        check("503 -> APIStatusError", err.status_code == 503 and err.response.headers.get("retry-after")
              and err.body["error"]["type"] == "overloaded_error", err)
    for t in holders:
        t.join()
    print("anthropic client check: all passed")


run(main)
