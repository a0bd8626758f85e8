#!/usr/bin/env python3
"""The official `openai` Python client against prefixlb in front of two mock engines.

    python3 tests/clients/openai_check.py target/debug/prefixlb

Starts the engines and the balancer itself (loopback, ports chosen by the OS), then
checks what a user of the client sees: chat completions with and without streaming,
completions, models, embeddings, audio transcriptions and translations (uploads,
plain and streamed), a streamed tool call, a Responses API conversation
chained by `previous_response_id` (plain and streamed, then read and deleted), and that our errors become the
client's exceptions (404 -> NotFoundError, 503 on saturation -> APIStatusError,
401 -> AuthenticationError). Exits non-zero on the first failure.
"""

import threading

import openai

from harness import balancer, check, engines, run

KEY = "sk-openai-check"


def main():
    lb = balancer(engines(2), "OPENAI_CHECK_KEYS", KEY)
    client = openai.OpenAI(base_url=f"http://{lb}/v1", api_key=KEY, max_retries=0, timeout=20)

    r = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    check("chat.completions.create", r.choices[0].message.content.strip() != "" and r.usage.prompt_tokens > 0, r)

    text, usage = "", None
    stream = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage:
            usage = chunk.usage
    check("chat.completions.create(stream=True)", len(text.split()) == 4 and usage is not None, (text, usage))

    r = client.completions.create(model="mock", prompt="Once upon a time", max_tokens=3)
    check("completions.create", r.choices[0].text.strip() != "", r)

    models = [m.id for m in client.models.list()]
    check("models.list", models == ["mock"], models)

    e = client.embeddings.create(model="mock", input=["a", "b"])
    check("embeddings.create", len(e.data) == 2 and len(e.data[0].embedding) == 8, e)

    # Audio: a multipart upload, as the SDK writes it; the mock engine's "transcript"
    # says what it received (model, file length, digest), so the upload came whole.
    audio = b"RIFF" + bytes(16_000) + bytes(range(256)) * 64
    said = f"model=mock bytes={len(audio)} "
    t = client.audio.transcriptions.create(model="mock", file=("speech.wav", audio, "audio/wav"), language="en")
    check("audio.transcriptions.create", t.text.startswith(said), t)
    t = client.audio.translations.create(model="mock", file=("speech.wav", audio, "audio/wav"))
    check("audio.translations.create", t.text.startswith(said), t)
    words = ""
    for event in client.audio.transcriptions.create(model="mock", file=("speech.wav", audio, "audio/wav"),
                                                    stream=True):
        # vLLM streams chat-shaped `transcription.chunk`s: the SDK keeps their fields.
        for choice in getattr(event, "choices", None) or []:
            words += (choice.get("delta") or {}).get("content") or ""
    check("audio.transcriptions.create(stream=True)", words.startswith(said), words)

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    name, args, finish = "", "", None
    for chunk in client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "x"}],
                                                tools=tools, stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        for call in c.delta.tool_calls or []:
            name += call.function.name or ""
            args += call.function.arguments or ""
        finish = c.finish_reason or finish
    check("a tool call in a stream", name == "lookup" and args == '{"x": 1}' and finish == "tool_calls",
          (name, args, finish))

    # The Responses API, a conversation chained by previous_response_id: each engine
    # keeps its own responses, so every turn must reach the one that answered the last.
    r = client.responses.create(model="mock", input="tell me about caches " * 30, max_output_tokens=4)
    check("responses.create", r.output_text.strip() != "" and r.usage.input_tokens > 0, r)
    with client.responses.stream(model="mock", input="and then? " * 10, previous_response_id=r.id,
                                 max_output_tokens=4) as s:
        for _ in s:
            pass
        r2 = s.get_final_response()
    check("responses.stream(previous_response_id=…)",
          r2.output_text.strip() != "" and r2.usage.input_tokens_details.cached_tokens > 0, r2)
    r3 = client.responses.create(model="mock", input="and last?", previous_response_id=r2.id, max_output_tokens=4)
    check("responses.create(previous_response_id=…)", r3.usage.input_tokens_details.cached_tokens > 0, r3)
    got = client.responses.retrieve(r3.id)
    check("responses.retrieve", got.id == r3.id and got.status == "completed", got)
    client.responses.delete(r3.id)
    try:
        client.responses.retrieve(r3.id)
        check("responses.retrieve after delete -> NotFoundError", False, "no exception")
    except openai.NotFoundError as err:
        check("responses.retrieve after delete -> NotFoundError", r3.id in str(err), err)

    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        check("404 -> NotFoundError", False, "no exception")
    except openai.NotFoundError as err:
        check("404 -> NotFoundError", err.status_code == 404 and "no-such-model" in str(err), err)

    try:
        openai.OpenAI(base_url=f"http://{lb}/v1", api_key="sk-wrong", max_retries=0).models.list()
        check("401 -> AuthenticationError", False, "no exception")
    except openai.AuthenticationError as err:
        check("401 -> AuthenticationError", err.status_code == 401, err)

    # Saturation: both nodes (cap 1 each) busy with long streams; the next is refused.
    started = threading.Barrier(3)

    def hold(session):
        s = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": session}],
                                           max_tokens=400, stream=True, extra_headers={"x-session-id": session})
        first = True
        for _ in s:
            if first:
                started.wait()
                first = False

    holders = [threading.Thread(target=hold, args=(f"hold-{i}",)) for i in range(2)]
    for t in holders:
        t.start()
    started.wait()
    try:
        client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "one more"}], max_tokens=1)
        check("503 -> APIStatusError", False, "no exception")
    except openai.APIStatusError as err:
        check("503 -> APIStatusError", err.status_code == 503 and err.response.headers.get("retry-after"), err)
    for t in holders:
        t.join()
    print("openai client check: all passed")


run(main)
