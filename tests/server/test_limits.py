"""What one client may send: body size and time, prompt length, stop conditions, sampling ranges,
valid Unicode, the Host header; and a slow tokenizer never stalls /health."""

import asyncio
import json
import socket
import threading
import time

import pytest
from starlette.testclient import TestClient

from optkit.server.app import build_app
from optkit.server.guards import BodyLimit, Limits, allowed_hosts, host_name
from tests.server.fake_engine import FakeEngine
from tests.server.test_api import KEY, assert_error

CAP = 4096


@pytest.fixture
def client(engine) -> TestClient:
    return TestClient(build_app(engine, None, limits=Limits(max_request_bytes=CAP)), raise_server_exceptions=False)


def post_raw(client: TestClient, path: str, content) -> object:
    return client.post(path, content=content, headers={"content-type": "application/json"})


# ---- the body: its size and how long it takes


def test_a_body_over_the_cap_is_413_before_it_is_parsed(client, engine):
    not_json = b"{" * (CAP + 1)  # parsed, it would be a 400
    response = post_raw(client, "/v1/completions", not_json)
    assert_error(response, 413, f"limit of {CAP} bytes", code="413")
    assert response.headers["connection"] == "close"
    assert engine.requests == {}
    under = json.dumps({"prompt": "x" * (CAP - 100), "max_tokens": 1}).encode()
    assert len(under) <= CAP and post_raw(client, "/v1/completions", under).status_code != 413


def test_a_chunked_body_growing_past_the_cap_is_413(client, engine):
    def chunks():  # no Content-Length: the size is only known while it arrives
        yield b'{"prompt": "'
        for _ in range(CAP // 512 + 1):
            yield b"x" * 512
        yield b'"}'

    response = post_raw(client, "/v1/completions", chunks())
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "over the server's limit")
    assert engine.requests == {}


def test_the_default_cap_leaves_room_for_a_context_filling_prompt(tokenizer):
    from optkit.server.guards import MIN_MAX_REQUEST_BYTES, default_max_request_bytes

    assert default_max_request_bytes(128) == MIN_MAX_REQUEST_BYTES == 4 << 20
    assert default_max_request_bytes(1 << 20) >= (1 << 20) * len('"\\u00e9",')


def test_a_body_that_does_not_arrive_in_time_is_408():
    async def app(scope, receive, send):
        raise AssertionError("the app must not run")

    messages = []

    async def trickle():  # the first bytes, then nothing
        if not messages:
            messages.append("first")
            return {"type": "http.request", "body": b'{"pro', "more_body": True}
        await asyncio.sleep(10)

    async def send(message):
        messages.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    started = time.monotonic()
    asyncio.run(BodyLimit(app, CAP, timeout_s=0.1)(scope, trickle, send))
    assert time.monotonic() - started < 2
    start, body = messages[1], messages[2]
    assert start["status"] == 408 and "did not arrive within 0.1 s" in json.loads(body["body"])["error"]["message"]


# ---- prompts: length, tokenisation off the event loop, Unicode


class SlowTokenizer:
    """The real tokenizer, but encoding a long text blocks its thread for `delay_s` (as a 4 MB prompt does)."""

    def __init__(self, tokenizer, delay_s: float):
        self._tokenizer, self.delay_s = tokenizer, delay_s
        self.encoding, self.encoded = threading.Event(), threading.Event()
        self.lengths = []  # of the texts encoded

    def encode(self, text, **kwargs):
        self.lengths.append(len(text))
        if len(text) > 1000:
            self.encoding.set()
            time.sleep(self.delay_s)
            self.encoded.set()
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self):
        return len(self._tokenizer)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_health_stays_fast_while_a_big_prompt_is_tokenized(tokenizer, route):
    slow = SlowTokenizer(tokenizer, delay_s=1.0)
    app = build_app(FakeEngine(slow), None)
    big = "a b " * 2000
    body = {"prompt": big} if route == "completions" else {"messages": [{"role": "user", "content": big}]}
    with TestClient(app) as client:
        result = {}
        worker = threading.Thread(target=lambda: result.update(r=client.post(f"/v1/{route}", json=body)))
        worker.start()
        assert slow.encoding.wait(5)
        latencies = []
        while not slow.encoded.is_set():
            started = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
        worker.join(10)
    assert len(latencies) >= 5, latencies  # /health answered many times while the prompt was tokenized
    assert max(latencies) < 0.25, latencies
    assert_error(result["r"], 400, "leaves no room to reply", code="context_length_exceeded")


def test_token_ids_longer_than_the_context_are_refused_before_they_are_checked(client, engine):
    response = client.post("/v1/completions", json={"prompt": [10**6] * 300})  # none in the vocabulary
    assert_error(response, 400, "the prompt has 300 tokens", param="prompt", code="context_length_exceeded")
    assert engine.requests == {}


SURROGATE = b'"\\ud800"'


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("completions", b'{"prompt": "hi \\ud800 there"}', "prompt"),
        ("completions", b'{"prompt": "hi", "stop": ["a", ' + SURROGATE + b"]}", "stop"),
        ("completions", b'{"prompt": "hi", "user": ' + SURROGATE + b"}", "user"),
        ("chat/completions", b'{"messages": [{"role": "user", "content": ' + SURROGATE + b"}]}", "messages.0.content"),
        (
            "chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": ' + SURROGATE + b"}]}]}",
            "messages.0.content",
        ),
        ("completions", b'{"model": "\\udfff", "prompt": "hi"}', "model"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_parameter(client, engine, route, body, param):
    response = post_raw(client, f"/v1/{route}", body)
    assert_error(response, 400, "lone surrogate (\\ud", param=param)
    assert engine.requests == {}


def test_a_server_failure_is_500_without_the_exception_text(client, engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("/secret/path/model.safetensors: sk-12345")

    monkeypatch.setattr(engine, "generate", broken)
    response = client.post("/v1/completions", json={"prompt": "hi"})
    error = assert_error(response, 500, "internal server error")
    assert error["type"] == "server_error"
    assert "secret" not in response.text and "sk-12345" not in response.text and "RuntimeError" not in response.text


# ---- stop conditions and sampling ranges


@pytest.mark.parametrize(
    "extra, fragment, param",
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4 stop strings are allowed, got 5", "stop"),
        ({"stop": "x" * 257}, "at most 256 characters", "stop"),
        ({"stop_token_ids": list(range(129))}, "at most 128", "stop_token_ids"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty must be in [0.01, 10]", "repetition_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in [0.01, 10]", "repetition_penalty"),
        ({"repetition_penalty": 11.0}, "repetition_penalty must be in [0.01, 10]", "repetition_penalty"),
        ({"temperature": -0.5}, "temperature must be >= 0", "temperature"),
        ({"top_p": 0}, "top_p must be in (0, 1]", "top_p"),
    ],
)
def test_out_of_range_stop_conditions_and_sampling_are_400(client, engine, extra, fragment, param):
    response = client.post("/v1/completions", json={"prompt": "hi"} | extra)
    assert_error(response, 400, fragment, param=param)
    assert engine.requests == {}


def test_non_finite_numbers_are_400(client):
    response = post_raw(client, "/v1/completions", b'{"prompt": "hi", "temperature": NaN}')
    assert_error(response, 400, "", param="temperature")


def test_four_stop_strings_and_stop_ids_reach_the_engine(client, engine):
    body = {"prompt": "hi", "stop": ["a", "b", "c", "d" * 256], "stop_token_ids": list(range(128)) * 2}
    assert client.post("/v1/completions", json=body).status_code == 400  # 256 ids: over the cap
    body["stop_token_ids"] = [5, 5, 7]
    assert client.post("/v1/completions", json=body).status_code == 200
    [(_, params)] = engine.requests.values()
    assert params.stop == ["a", "b", "c", "d" * 256] and params.stop_token_ids == {5, 7}


# ---- the Host header (DNS rebinding) and the API key


@pytest.mark.parametrize(
    "host, ok",
    [("127.0.0.1:8000", True), ("localhost", True), ("LOCALHOST:1", True), ("[::1]:8000", True),
     ("evil.example", False), ("evil.example:8000", False), ("127.0.0.1.evil.example", False)],
)  # fmt: skip
def test_without_a_key_the_host_must_name_this_server(engine, host, ok):
    client = TestClient(build_app(engine, None, limits=Limits(hosts=allowed_hosts("127.0.0.1"))))
    for path in ("/health", "/v1/models"):
        response = client.get(path, headers={"host": host})
        if ok:
            assert response.status_code == 200
        else:
            assert_error(response, 403, "does not name this server", code="invalid_host")


def test_allowed_hosts():
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("::") is None  # every interface: any name
    assert allowed_hosts("::1") == {"localhost", "127.0.0.1", "[::1]"}
    extra = allowed_hosts("10.0.0.5", ["API.internal:443"])
    assert extra == {"localhost", "127.0.0.1", "[::1]", "10.0.0.5", "api.internal"}
    assert host_name("[::1]:80") == "[::1]" and host_name("Example.COM:8080") == "example.com"


def test_with_a_key_any_host_is_served_and_metrics_need_the_key(engine):
    app = build_app(engine, KEY, limits=Limits(hosts=allowed_hosts("127.0.0.1")))
    client = TestClient(app)
    auth = {"Authorization": f"Bearer {KEY}", "host": "api.example.com"}
    assert client.get("/v1/models", headers=auth).status_code == 200
    assert client.get("/health", headers={"host": "api.example.com"}).status_code == 200
    assert_error(client.get("/metrics"), 401, "missing API key")
    assert client.get("/metrics", headers=auth).status_code == 200


# ---- connections: a request head must arrive in time (uvicorn with optkit's protocol)


def test_a_connection_that_trickles_its_head_is_closed(engine):
    import uvicorn

    from optkit.server.transport import HeadDeadlineProtocol

    class Quick(HeadDeadlineProtocol):
        head_timeout_s = 0.3

    async def scenario() -> tuple[bytes, float, bytes]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(engine, None), http=Quick, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHo")
            started = time.monotonic()
            closed = await asyncio.wait_for(reader.read(), 5)
            elapsed = time.monotonic() - started
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # a prompt client is served
            writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 5)
            return closed, elapsed, answer
        finally:
            server.should_exit = True
            await task

    closed, elapsed, answer = asyncio.run(scenario())
    assert closed == b"" and 0.2 < elapsed < 3
    assert answer.startswith(b"HTTP/1.1 200")


class CountingTokenizer:
    """One token per `chars_per_token` characters; records the length of every text it encodes."""

    def __init__(self, chars_per_token: int):
        self.chars_per_token, self.encoded = chars_per_token, []

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return [1] * (len(text) // self.chars_per_token)


def test_a_text_far_over_the_context_is_refused_from_its_head():
    from optkit.server.errors import APIError
    from optkit.server.prompts import PROBE_CHARS_PER_TOKEN, encode_within

    tokenizer = CountingTokenizer(chars_per_token=4)
    with pytest.raises(APIError, match="more than .* context limit of 128 tokens"):
        encode_within(tokenizer, "x" * 4_000_000, 128, "prompt")
    assert tokenizer.encoded == [PROBE_CHARS_PER_TOKEN * 128]
    long_tokens = CountingTokenizer(chars_per_token=100)  # 100 characters a token: the whole text fits
    assert len(encode_within(long_tokens, "x" * 12_000, 128, "prompt")) == 120
    assert long_tokens.encoded == [PROBE_CHARS_PER_TOKEN * 128, 12_000]


def test_a_big_prompt_is_refused_without_tokenizing_all_of_it(tokenizer, engine):  # 1.8 MB, context 128
    engine.tokenizer = recording = SlowTokenizer(tokenizer, delay_s=0)
    client = TestClient(build_app(engine, None))
    response = client.post("/v1/completions", json={"prompt": "lorem ipsum dolor " * 100_000})
    assert_error(response, 400, "the prompt has more than", param="prompt", code="context_length_exceeded")
    assert recording.lengths == [16 * 128]
