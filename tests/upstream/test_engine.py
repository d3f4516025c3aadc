"""An OpenAI-compatible upstream as a served model (upstream/engine.py, `optkit serve --backend`),
against a fake upstream (fake_upstream.py) that fails as a chosen fault: every failure reaches the
client as OpenAI's error body with 502/504 (never the upstream's text or a traceback), a client that
goes away closes the upstream's stream, and the client's key never reaches the upstream."""

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from optkit.errors import OptkitError
from optkit.routing.router import Router
from optkit.runtime.engine import QueueFull
from optkit.runtime.sequence import SamplingParams
from optkit.server.app import build_app
from optkit.upstream.engine import UpstreamLimits, connect
from tests.upstream.fake_upstream import fake_upstream

KEY = "client-secret"


@pytest.fixture
def upstream(small_dir):
    with fake_upstream(str(small_dir)) as fake:
        yield fake


def client_for(upstream, api_key=None, **limits) -> TestClient:
    engine = connect("up", upstream.url, None, "upstream-secret", UpstreamLimits(**limits))
    return TestClient(build_app(Router({"up": engine}), api_key=api_key), raise_server_exceptions=False)


def test_an_upstream_answers_streamed_and_whole_with_its_token_ids_and_its_own_key(upstream):
    client = client_for(upstream, api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    whole = client.post("/v1/completions", json={"model": "up", "prompt": "the cat", "max_tokens": 5}, headers=auth)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["text"] == "<11><12><13><14><15>"
    assert whole.json()["usage"]["completion_tokens"] == 5 and whole.headers["x-optkit-model"] == "up"
    body = {"model": "up", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=auth) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    deltas = [json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events]
    assert "".join(deltas) == "<11><12><13><14><15>"
    sent = upstream.bodies[0]
    assert sent["model"] == "served-small" and sent["stream"] and all(isinstance(t, int) for t in sent["prompt"])
    assert all(h.get("Authorization") == "Bearer upstream-secret" for h in upstream.headers)
    assert not any(KEY in json.dumps(h) for h in upstream.headers)


@pytest.mark.parametrize(
    ("mode", "status", "says"),
    [
        ("error500", 502, "answered 500"),
        ("malformed", 502, "broke the stream"),
        ("hang", 504, "sent nothing for 0.5 s"),
    ],
)
def test_an_upstream_failure_is_an_openai_error_naming_the_upstream(upstream, mode, status, says):
    upstream.mode = mode
    client = client_for(upstream, read_timeout_s=0.5)
    for stream in (False, True):
        answer = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 5, "stream": stream})
        assert answer.status_code == status
        error = answer.json()["error"]
        assert says in error["message"] and "upstream up" in error["message"] and error["code"] == "upstream_error"
        assert "secret" not in answer.text and "Traceback" not in answer.text


def test_a_stream_the_upstream_breaks_midway_ends_with_an_error_event(upstream):
    upstream.mode = "malformed_late"
    client = client_for(upstream)
    with client.stream("POST", "/v1/completions", json={"prompt": "the cat", "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-2][6:])["error"]["type"] == "server_error" and lines[-1] == "data: [DONE]"


def test_a_refused_connection_is_a_502(upstream):
    engine = connect("up", upstream.url, None, None, UpstreamLimits())
    engine.url = "http://127.0.0.1:9"  # discard: nothing listens there
    client = TestClient(build_app(Router({"up": engine}), api_key=None), raise_server_exceptions=False)
    answer = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 5})
    assert answer.status_code == 502 and "refused the connection" in answer.json()["error"]["message"]


def test_a_consumer_that_goes_away_closes_the_upstream_stream_and_frees_its_slot(upstream):
    upstream.mode = "slow"
    engine = connect("up", upstream.url, None, None, UpstreamLimits(max_concurrency=1, max_waiting=0))
    params = SamplingParams(max_tokens=5)

    async def run():
        first = engine.generate([1, 2, 3], params, "a")
        assert (await anext(first)).token_ids == [11, 12]
        blocked = engine.generate([1, 2, 3], params, "b")
        with pytest.raises(QueueFull):  # one in flight, none may wait
            await anext(blocked)
        await first.aclose()
        again = engine.generate([1, 2, 3], params, "c")
        assert (await anext(again)).token_ids == [11, 12]
        await again.aclose()

    asyncio.run(run())
    assert upstream.went_away.wait(5)


def test_an_upstream_that_is_not_there_or_not_openai_is_one_line(small_dir, upstream):
    with pytest.raises(OptkitError, match="--backend up=http://127.0.0.1:9: its /v1/models did not name a model"):
        connect("up", "http://127.0.0.1:9", None, None, UpstreamLimits(connect_timeout_s=2))
    with pytest.raises(OptkitError, match="give the upstream's URL"):
        connect("up", "ftp://x", None, None, UpstreamLimits())


def test_upstreams_come_from_the_command_line_only(run_cli, tmp_path, monkeypatch):
    from optkit.routing.config import serve_options

    with pytest.raises(OptkitError, match="only from the command line"):
        serve_options({"models": {"a": {"path": "small"}}, "backends": {"b": {"url": "http://x:1"}}})
    recipe = tmp_path / "serve.yaml"
    recipe.write_text("serve:\n  backends: {b: {url: 'http://evil:1'}}\n  models: {a: {path: small}}\n")
    code, _, err = run_cli("serve", "--recipe", str(recipe))
    assert code == 2 and "only from the command line" in err
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    code, _, err = run_cli("serve", "--backend", "b=http://127.0.0.1:9", "--backend-key", "b=NO_SUCH_KEY_VAR")
    assert code == 2 and "NO_SUCH_KEY_VAR is not set" in err


def test_a_shadow_pair_takes_one_vllm_upstream_with_the_same_tokenizer(upstream, small_dir):
    from optkit.routing.config import serve_options
    from optkit.routing.startup import check_upstream_pairs

    data = {"models": {"a": {"path": "small"}}, "backends": {"b": {"url": "http://x:1"}, "c": {"url": "http://y:1"}}}
    with pytest.raises(OptkitError, match="both are upstreams"):
        serve_options({**data, "shadow": {"pairs": {"b": "c"}}}, command_line=True)
    options = serve_options({**data, "shadow": {"pairs": {"a": "b"}}}, command_line=True)
    local = connect("a", upstream.url, str(small_dir), None, UpstreamLimits())  # small's tokenizer
    check_upstream_pairs(options, {"a": local, "b": connect("b", upstream.url, None, None, UpstreamLimits())})
    upstream.owned_by = "optkit"
    with pytest.raises(OptkitError, match="not a vLLM server"):
        check_upstream_pairs(options, {"a": local, "b": connect("b", upstream.url, None, None, UpstreamLimits())})
