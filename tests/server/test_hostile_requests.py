"""What a model directory or a client can do to the server: a config.json whose context length would
raise the body cap to gigabytes, the API pages without the key, chat templates that never end."""

from starlette.testclient import TestClient

from optkit.server.app import build_app
from optkit.server.guards import MAX_DEFAULT_REQUEST_BYTES, MIB, Limits
from tests.server.fake_engine import FakeEngine
from tests.server.test_api import KEY, assert_error

DOCS_PAGES = ("/docs", "/redoc", "/openapi.json")


def post_raw(client: TestClient, body: bytes):
    return client.post("/v1/completions", content=body, headers={"content-type": "application/json"})


# ---- the body cap: config.json does not decide it


def test_a_huge_context_in_config_json_does_not_raise_the_body_cap_past_16_mib(tokenizer):
    engine = FakeEngine(tokenizer, max_model_len=10**9)  # max_position_embeddings: 1e9
    client = TestClient(build_app(engine, None), raise_server_exceptions=False)
    response = post_raw(client, b"{" * (17 * MIB))
    assert_error(response, 413, f"limit of {MAX_DEFAULT_REQUEST_BYTES} bytes", code="413")
    assert MAX_DEFAULT_REQUEST_BYTES == 16 * MIB
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
