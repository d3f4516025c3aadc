"""What a model directory or a client can do to the server: a config.json whose context length would
raise the body cap to gigabytes, the API pages without the key, chat templates that never end."""

import copy
import threading
import time

import pytest
from starlette.testclient import TestClient

from optkit.server.app import build_app
from optkit.server.chat import chat_prompt_text
from optkit.server.guards import MIB, Limits
from optkit.server.protocol import ChatMessage
from tests.server.fake_engine import FakeEngine
from tests.server.test_api import KEY, assert_error

DOCS_PAGES = ("/docs", "/redoc", "/openapi.json")
MAX_DEFAULT_REQUEST_BYTES = 16 * MIB  # whatever config.json says


def post_raw(client: TestClient, body: bytes):
    return client.post("/v1/completions", content=body, headers={"content-type": "application/json"})


# ---- the body cap: config.json does not decide it


def test_a_huge_context_in_config_json_does_not_raise_the_body_cap_past_16_mib(tokenizer):
    engine = FakeEngine(tokenizer, max_model_len=10**9)  # max_position_embeddings: 1e9
    client = TestClient(build_app(engine, None), raise_server_exceptions=False)
    response = post_raw(client, b"{" * (17 * MIB))
    assert_error(response, 413, f"limit of {MAX_DEFAULT_REQUEST_BYTES} bytes", code="413")
    assert engine.requests == {}


def test_the_command_line_may_raise_the_cap_past_16_mib(tokenizer):
    engine = FakeEngine(tokenizer, max_model_len=10**9)
    limits = Limits(max_request_bytes=32 * MIB)  # --max-request-bytes
    client = TestClient(build_app(engine, None, limits=limits), raise_server_exceptions=False)
    assert_error(post_raw(client, b"{" * (17 * MIB)), 400, "not valid JSON")  # past the cap, to the parser


# ---- FastAPI's pages: not served unless asked, and then behind the key


def test_the_api_pages_are_not_served_by_default(engine):
    for key in (None, KEY):
        client = TestClient(build_app(engine, key), raise_server_exceptions=False)
        auth = {"Authorization": f"Bearer {KEY}"} if key else {}
        for page in DOCS_PAGES:
            assert_error(client.get(page, headers=auth), 404, f"no route GET {page}")


def test_with_docs_the_pages_need_the_key_when_there_is_one(engine):
    open_client = TestClient(build_app(engine, None, docs=True))
    assert all(open_client.get(page).status_code == 200 for page in DOCS_PAGES)
    client = TestClient(build_app(engine, KEY, docs=True))
    for page in DOCS_PAGES:
        assert_error(client.get(page), 401, "missing API key", code="invalid_api_key")
        assert client.get(page, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert "/v1/completions" in client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["paths"]
    assert client.get("/health").status_code == 200  # the load balancer's probe stays open


def test_serve_has_a_docs_flag(run_cli):
    code, out, _ = run_cli("serve", "--help")
    assert code == 0 and "--docs" in out


# ---- chat templates: a time and size budget, and the pool keeps serving


HANG = "{% for i in range(12000) %}{% for j in range(12000) %}{% endfor %}{% endfor %}"  # about 10 s without a limit
TEMPLATE = (
    "{% if messages[0].content == 'hang' %}" + HANG + "{% endif %}"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def templated(tokenizer):
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = TEMPLATE
    return templated


def in_thread(work) -> tuple[threading.Thread, dict]:
    """`work()` on a daemon thread: a request that never ends fails the test instead of hanging it."""
    result = {}

    def run():
        started = time.monotonic()
        result["response"] = work()
        result["took"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def post_in_threads(client: TestClient, path: str, body: dict, n: int) -> list[tuple[threading.Thread, dict]]:
    return [in_thread(lambda: client.post(path, json=body)) for _ in range(n)]


def assert_finishes_within(client: TestClient, path: str, body: dict, seconds: float) -> None:
    thread, result = in_thread(lambda: client.post(path, json=body))
    thread.join(seconds)
    assert not thread.is_alive(), f"{path} took over {seconds} s"
    assert result["response"].status_code == 200, result["response"].text


NORMAL = (
    ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
)
HANG_BODY = {"messages": [{"role": "user", "content": "hang"}], "max_tokens": 1}


def test_after_8_hostile_templates_a_normal_completion_finishes_within_5_s(templated):
    engine = FakeEngine(templated)
    with TestClient(build_app(engine, None), raise_server_exceptions=False) as client:  # the default limits
        hostile = post_in_threads(client, "/v1/chat/completions", HANG_BODY, 8)
        for thread, result in hostile:
            thread.join(30)
            assert not thread.is_alive(), "a hostile chat template still holds its thread after 30 s"
            assert_error(result["response"], 400, "chat template took over 2 s to render", param="messages")
        for path, body in NORMAL:
            assert_finishes_within(client, path, body, 5)
        assert client.get("/health").json() == {"status": "ok"}


def test_while_8_hostile_templates_run_other_requests_are_served(templated):
    engine = FakeEngine(templated)
    app = build_app(engine, None, limits=Limits(chat_template_timeout_s=0.5))
    with TestClient(app, raise_server_exceptions=False) as client:
        hostile = post_in_threads(client, "/v1/chat/completions", HANG_BODY, 8)
        time.sleep(0.2)  # every tokenizer thread is taken by one of them now
        for path, body in NORMAL:
            assert_finishes_within(client, path, body, 5)
        for thread, result in hostile:
            thread.join(30)
            assert not thread.is_alive()
            assert_error(result["response"], 400, "chat template took over 0.5 s to render", param="messages")


def test_a_template_whose_output_passes_the_budget_is_400(templated):
    templated.chat_template = "{% for i in range(1000) %}{{ 'x' * 10000 }}{% endfor %}"  # 10 M characters
    engine = FakeEngine(templated)
    app = build_app(engine, None, limits=Limits(max_request_bytes=1 * MIB))  # renders up to 2 MiB characters
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1})
        assert_error(response, 400, f"rendered over {2 * MIB} characters", param="messages")
    assert engine.requests == {}


def test_a_render_past_its_time_is_stopped_and_its_worker_killed():
    from optkit.server.template_render import TemplateBudgetExceeded, TemplateRenderer

    renderer = TemplateRenderer(timeout_s=0.5, max_chars=10_000)
    try:
        assert renderer.render(TEMPLATE, HI, {}) == "[user] hi [assistant]"
        [worker] = renderer._workers
        started = time.monotonic()
        with pytest.raises(TemplateBudgetExceeded, match="took over 0.5 s"):
            renderer.render(TEMPLATE, [{"role": "user", "content": "hang"}], {})
        assert time.monotonic() - started < 3
        assert worker.process.poll() is not None  # killed: nothing is left spinning
        assert renderer.render(TEMPLATE, HI, {"bos_token": "<s>"}) == "[user] hi [assistant]"  # a fresh worker
    finally:
        renderer.close()
    assert not renderer._workers


def test_the_worker_renders_as_transformers_does(templated):
    """The environment mirrors apply_chat_template's: its filters, globals and tags give the same text."""
    from optkit.server.template_render import TemplateRenderer

    templated.chat_template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% if loop.last %}{% break %}{% endif %}{% endfor %}"
        "{{ dict(a=1) | tojson }} {{ ns.n }}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    messages = [{"role": "system", "content": "Be terse ü"}, {"role": "user", "content": "hi"}]
    renderer = TemplateRenderer(timeout_s=10, max_chars=10_000)
    try:
        expected = templated.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat_prompt_text(templated, [ChatMessage(**m) for m in messages], renderer) == (expected, False)
    finally:
        renderer.close()
