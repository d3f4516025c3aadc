"""The OpenAI-compatible app in process, over a fake engine: formats, errors, auth, metrics, disconnects."""

import asyncio
import json

import pytest
from starlette.requests import ClientDisconnect
from starlette.testclient import TestClient

from optkit.server.app import build_app
from tests.metrics_text import metric_samples
from tests.server.fake_engine import FakeEngine

KEY = "sk-test"


@pytest.fixture
def client(engine) -> TestClient:
    return TestClient(build_app(engine, api_key=None), raise_server_exceptions=False)


def events(response) -> list:
    """Server-sent events: the JSON objects, then "[DONE]"; every event is `data: ...\\n\\n`."""
    text = response.text
    assert text.endswith("\n\n")
    chunks = text[:-2].split("\n\n")
    assert all(c.startswith("data: ") for c in chunks), text
    return [c[6:] if c[6:] == "[DONE]" else json.loads(c[6:]) for c in chunks]


def assert_error(response, status: int, fragment: str, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"], error
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_health_and_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [("small", "model", 128)]
    assert client.get("/v1/models/small").json()["id"] == "small"
    assert_error(client.get("/v1/models/large"), 404, "'large' does not exist", code="model_not_found")


def test_completion(client, engine, tokenizer):
    body = {"model": "small", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "top_k": 5,
            "min_p": 0.1, "seed": 7, "stop": "zzz", "presence_penalty": 0.5, "frequency_penalty": 0.25,
            "repetition_penalty": 1.1, "user": "ignored", "stream": False}  # fmt: skip
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    prompt_ids = tokenizer.encode("Once upon a time")
    assert data["object"] == "text_completion" and data["model"] == "small" and data["id"].startswith("cmpl-")
    [choice] = data["choices"]
    assert choice["text"] == tokenizer.decode(engine.expected_ids(prompt_ids, 5))
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None and choice["index"] == 0
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": 5, "total_tokens": len(prompt_ids) + 5}
    assert data["usage"] == usage | {"prompt_tokens_details": {"cached_tokens": 0}}
    [(seen_ids, params)] = engine.requests.values()
    assert seen_ids == prompt_ids
    assert (params.max_tokens, params.temperature, params.top_k, params.min_p, params.seed, params.stop) == (
        5, 0, 5, 0.1, 7, ["zzz"])  # fmt: skip
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, 0.25, 1.1)
    assert engine.aborted == []


def test_completion_defaults_token_ids_stop_and_logprobs(client, engine, tokenizer):
    data = client.post("/v1/completions", json={"prompt": [5, 6, 7]}).json()
    [(seen_ids, params)] = engine.requests.values()
    assert seen_ids == [5, 6, 7] and params.max_tokens == 16 and params.temperature == 1.0
    assert data["usage"]["completion_tokens"] == 16

    expected = tokenizer.decode(engine.expected_ids([1, 2], 16))
    stop = expected.split()[3]
    data = client.post("/v1/completions", json={"prompt": [1, 2], "stop": [stop, "never"]}).json()
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["choices"][0]["text"] == expected[: expected.find(stop)]

    data = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "logprobs": 2}).json()
    logprobs = data["choices"][0]["logprobs"]
    tokens = [tokenizer.decode([t]) for t in engine.expected_ids([1, 2], 3)]
    assert logprobs["tokens"] == tokens and logprobs["token_logprobs"] == [-0.5] * 3
    assert [len(top) for top in logprobs["top_logprobs"]] == [2, 2, 2]
    assert logprobs["text_offset"] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]


def test_chat_default_template(client, engine, tokenizer):
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": parts}]
    data = client.post("/v1/chat/completions", json={"model": "small", "messages": messages, "temperature": 0}).json()
    prompt_ids = tokenizer.encode("<|system|>\nBe terse.\n<|user|>\nHi\nthere\n<|assistant|>\n")
    [(seen_ids, params)] = engine.requests.values()
    assert seen_ids == prompt_ids
    assert params.max_tokens == 128 - len(prompt_ids)  # the rest of the context, as OpenAI does
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    [choice] = data["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": tokenizer.decode(engine.expected_ids(prompt_ids, params.max_tokens)),
    }
    assert choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == params.max_tokens

    body = {"messages": messages, "max_tokens": 9, "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 1}
    data = client.post("/v1/chat/completions", json=body).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and data["usage"]["completion_tokens"] == 3
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"} and len(content[0]["top_logprobs"]) == 1


def test_chat_uses_the_tokenizers_template(tokenizer):
    import copy

    templated = copy.deepcopy(tokenizer)
    templated.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "[{{ m.role }}] {{ m.content }} {% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    engine = FakeEngine(templated)
    client = TestClient(build_app(engine, None))
    response = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    )
    assert response.status_code == 200
    [(seen_ids, _)] = engine.requests.values()
    assert seen_ids == templated.encode("[user] Hi [assistant]", add_special_tokens=False)
    bad = client.post("/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]})
    assert_error(bad, 400, "chat template rejected the messages: no tools", param="messages")


def test_stream_completion(client, engine, tokenizer):
    whole = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6}).json()["choices"][0]["text"]
    response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    *chunks, done = events(response)
    assert done == "[DONE]"
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]

    body = {"prompt": "Hello", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    *chunks, usage_chunk, done = events(client.post("/v1/completions", json=body))
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3


def test_stream_chat(client):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    *chunks, usage_chunk, done = events(client.post("/v1/chat/completions", json=body))
    assert done == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks + [usage_chunk])
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(set(c["delta"]) == {"content"} and c["finish_reason"] is None for c in choices[1:-1])
    assert choices[-1]["delta"] == {} and choices[-1]["finish_reason"] == "length"
    text = "".join(c["delta"]["content"] for c in choices[1:-1])
    whole = TestClient(build_app(FakeEngine(client.app.state.served.engine.tokenizer), None)).post(
        "/v1/chat/completions", json={**body, "stream": False}
    )
    assert text == whole.json()["choices"][0]["message"]["content"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4


BAD_REQUESTS = [  # (route, raw body or JSON, message fragment, param)
    ("completions", b'{"prompt": "hi",', "not valid JSON", None),
    ("completions", b"", "needs a JSON body", None),
    ("completions", [1, 2], "must be a JSON object", None),
    ("completions", {}, "prompt is required", "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": "16"}, "max_tokens: Input should be a valid integer", "max_tokens"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream: Input should be a valid boolean", "stream"),
    ("completions", {"prompt": "hi", "temprature": 0}, "unknown parameter 'temprature'", "temprature"),
    ("completions", {"prompt": "hi", "n": 2}, "only n=1 is supported", "n"),
    ("completions", {"prompt": "hi", "echo": True}, "echo is not supported", "echo"),
    ("completions", {"prompt": "hi", "best_of": 3}, "best_of is not supported", "best_of"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 1}}, "logit_bias is not supported", "logit_bias"),
    ("completions", {"prompt": ["a", "b"]}, "batched prompts are not supported", "prompt"),
    ("completions", {"prompt": [1.5]}, "prompt: Input should be a valid string; or", "prompt"),
    ("completions", {"prompt": ""}, "the prompt is empty", "prompt"),
    ("completions", {"prompt": [1, 99999]}, "token id 99999 is not in the vocabulary", "prompt"),
    ("completions", {"prompt": "hi", "stop": ["ok", ""]}, "stop strings must not be empty", "stop"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed: Input should be less than", "seed"),
    ("completions", b'{"prompt": "hi", "temperature": NaN}', "temperature: Input should be a finite number", None),
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature must be >= 0", None),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p must be in (0, 1]", None),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens must be at least 1", None),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs must be in [0, 20]", None),
    ("completions", {"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty must be in [-2, 2]", None),
    (
        "completions",
        {"prompt": [1] * 100, "max_tokens": 29},
        "the prompt has 100 tokens and max_tokens is 29",
        "max_tokens",
    ),
    ("chat/completions", {"messages": []}, "messages: List should have at least 1 item", "messages"),
    (
        "chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        "Input should be 'system'",
        "messages.0.role",
    ),
    ("chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role is required", "messages.0.role"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "only text content parts are supported",
        "messages.0.content",
    ),  # fmt: skip
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "needs logprobs: true",
        None,
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": []},
        "unknown parameter 'tools'",
        "tools",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": " x" * 200}]},
        "leaves no room to reply",
        "messages",
    ),
]


@pytest.mark.parametrize("route, body, fragment, param", BAD_REQUESTS)
def test_bad_requests_are_400_with_openai_errors(client, engine, route, body, fragment, param):
    if isinstance(body, bytes):
        response = client.post(f"/v1/{route}", content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(f"/v1/{route}", json=body)
    error = assert_error(response, 400, fragment, param)
    assert error["type"] == "invalid_request_error"
    assert engine.requests == {}  # never reached the engine


def test_a_form_body_is_400_naming_the_content_type(client):
    # curl -d without -H 'Content-Type: application/json' sends a form
    response = client.post("/v1/completions", data={"prompt": "hi"})
    assert_error(response, 400, "send it with Content-Type: application/json")


def test_context_limit_message_names_the_numbers(client):
    error = assert_error(client.post("/v1/completions", json={"prompt": [1] * 100, "max_tokens": 29}), 400, "")
    assert "100" in error["message"] and "29" in error["message"] and "context limit of 128" in error["message"]


def test_unknown_model_route_and_method(client):
    for route, body in [("completions", {"prompt": "hi"}), ("chat/completions", {"messages": [{"role": "user"}]})]:
        assert_error(client.post(f"/v1/{route}", json={**body, "model": "gpt-4"}), 404, "'gpt-4' does not exist",
                     "model", "model_not_found")  # fmt: skip
    assert_error(client.get("/v1/nothing"), 404, "no route GET /v1/nothing")
    assert_error(client.get("/v1/completions"), 405, "no route GET /v1/completions")


@pytest.mark.parametrize("stream", [False, True])
def test_queue_full_is_503_with_retry_after(client, engine, stream):
    engine.queue_full = True
    response = client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
    error = assert_error(response, 503, "the server is busy", code="overloaded")
    assert error["type"] == "server_error"
    assert response.headers["retry-after"] == "1"


def test_engine_value_error_is_400(client, engine, monkeypatch):
    async def refuse(prompt_ids, params, request_id):  # the engine's own check, past the server's
        raise ValueError("the prompt is too long for this engine")
        yield  # an async generator, as the real one

    monkeypatch.setattr(engine, "generate", refuse)
    for stream in (False, True):
        response = client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
        assert_error(response, 400, "too long for this engine")


def test_engine_failure_is_a_500_or_error_event_without_the_exception_text(client, engine):
    engine.fail_after = 2
    *chunks, error, done = events(client.post("/v1/completions", json={"prompt": "hi", "stream": True}))
    assert len(chunks) == 2 and done == "[DONE]"
    assert error["error"]["type"] == "server_error" and "log" in error["error"]["message"]
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert assert_error(response, 500, "internal server error")["type"] == "server_error"
    assert "injected" not in response.text and "RuntimeError" not in response.text
    assert "injected" not in json.dumps(error)


def test_auth(engine):
    client = TestClient(build_app(engine, api_key=KEY))
    body = {"prompt": "hi", "max_tokens": 2}
    assert_error(client.post("/v1/completions", json=body), 401, "missing API key", code="invalid_api_key")
    wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert_error(wrong, 401, "incorrect API key")
    assert wrong.headers["www-authenticate"] == "Bearer"
    assert_error(client.get("/v1/models"), 401, "missing API key")
    malformed = client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert_error(malformed, 401, "missing API key")  # authentication comes before parsing
    ok = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200
    assert_error(client.get("/metrics"), 401, "missing API key")  # it names the models and their traffic
    assert client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_metrics(client, engine):
    for max_tokens in (3, 4):
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens})
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stop": [" "]})
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = metric_samples(response.text)
    assert samples["optkit:time_to_first_token_seconds_count"] == 3
    assert samples["optkit:time_per_output_token_seconds_count"] == 2  # the stopped one had one token
    assert samples["optkit:e2e_request_latency_seconds_count"] == 3
    assert samples['optkit:request_success_total{finish_reason="length"}'] == 2
    assert samples['optkit:request_success_total{finish_reason="stop"}'] == 1
    assert samples["optkit:num_requests_running"] == 0 and samples["optkit:num_requests_waiting"] == 0
    assert samples["optkit:kv_cache_usage_perc"] == 0
    assert samples["optkit:prompt_tokens_total"] == engine.num_prompt_tokens > 0
    assert samples["optkit:generation_tokens_total"] == engine.num_generation_tokens == 8
    assert samples["optkit:prefix_cache_hit_tokens_total"] == 3
    assert samples["optkit:num_preemptions_total"] == 0


def test_lifespan_shuts_the_engine_down(engine):
    with TestClient(build_app(engine, None, shutdown_engine=True)) as client:
        assert client.get("/health").status_code == 200
    assert engine.shut_down


# ---- clients that go away: driven at the ASGI level, where the disconnect is exact


async def call_asgi(app, path: str, body: dict, spec_version: str, gone_after_chunks: int | None, block_send=False):
    """POST `body`; the client disconnects after `gone_after_chunks` non-empty body chunks (spec
    2.3: `http.disconnect` on receive; spec 2.4: the next send raises OSError), or, when None,
    0.05 s after the request. With `block_send`, the send of the last chunk never completes, so the
    response is cancelled while the event generator waits at a yield, not on the engine."""
    gone = asyncio.Event()
    request_sent = False
    messages = []

    async def receive():
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if gone.is_set() and spec_version == "2.4":
            raise OSError("connection reset")
        messages.append(message)
        chunks = [m for m in messages if m["type"] == "http.response.body" and m.get("body")]
        if gone_after_chunks is not None and len(chunks) >= gone_after_chunks:
            gone.set()
            if block_send:  # the client stopped reading, then went away: cancelled inside this send
                await asyncio.Event().wait()

    async def disconnect_later():
        await asyncio.sleep(0.05)
        gone.set()

    headers = [(b"content-type", b"application/json"), (b"host", b"test")]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1234), "server": ("test", 80)}  # fmt: skip
    timer = asyncio.ensure_future(disconnect_later()) if gone_after_chunks is None else None
    try:
        await asyncio.wait_for(app(scope, receive, send), 5)
    except ClientDisconnect:
        pass  # spec 2.4: starlette turns the failed send into ClientDisconnect
    finally:
        if timer:
            timer.cancel()
    return messages


async def until_returned(engine: FakeEngine, call) -> tuple[list, list]:
    """The ASGI messages, and the requests aborted by the time the app returned (not later, when
    the garbage collector would finalize a generator left open)."""
    messages = await call
    return messages, list(engine.aborted)


@pytest.mark.parametrize(
    "spec_version, block_send",
    [("2.3", False), ("2.3", True), ("2.4", False)],
    ids=["receive", "send-blocked", "send-fails"],
)
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_disconnect_mid_stream_aborts_the_request(engine, route, spec_version, block_send):
    engine.step_s = 0.01
    app = build_app(engine, None)
    body = {"prompt": "hi"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    body |= {"max_tokens": 100, "stream": True}
    messages, aborted = asyncio.run(
        until_returned(engine, call_asgi(app, f"/v1/{route}", body, spec_version, 2, block_send))
    )
    assert messages[0]["status"] == 200
    [request_id] = engine.requests
    assert aborted == [request_id] and engine.running == set() and engine.num_generation_tokens < 50
    assert b'optkit:request_success_total{finish_reason="abort"} 1.0' in TestClient(app).get("/metrics").content


@pytest.mark.parametrize(
    "stream, first_delay_s", [(False, 0.0), (False, 1.0), (True, 1.0)], ids=["generating", "queued", "stream-queued"]
)
def test_disconnect_before_the_response_aborts_the_request(engine, stream, first_delay_s):
    engine.step_s, engine.first_delay_s = 0.01, first_delay_s
    app = build_app(engine, None)
    body = {"prompt": "hi", "max_tokens": 100, "stream": stream}
    messages, aborted = asyncio.run(until_returned(engine, call_asgi(app, "/v1/completions", body, "2.3", None)))
    assert all(m.get("status") in (None, 499) for m in messages)  # nobody was there to read a response
    [request_id] = engine.requests
    assert aborted == [request_id] and engine.running == set() and engine.num_generation_tokens < 50
