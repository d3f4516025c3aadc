"""The router behind the OpenAI app, over fake engines: by name, tiers, spill-over, prefixes,
shadow replays and fallback, and what /metrics and /v1/optkit show of them."""

import pytest
from starlette.testclient import TestClient

from optkit.routing.config import ServeOptions
from optkit.routing.fallback import FallbackMonitor
from optkit.routing.load import LoadTracker
from optkit.routing.online import ShadowScore
from optkit.routing.router import Prompt, Router
from optkit.routing.shadow import ShadowService
from optkit.server.app import build_app
from tests.metrics_text import metric_samples
from tests.server.fake_engine import FakeEngine

LONG = "the cat sat on the mat " * 8  # 48 tokens


@pytest.fixture(scope="module")
def tokenizer():
    from optkit.modeldir import load_tokenizer

    return load_tokenizer("small")


def engines(tokenizer, *names: str) -> dict[str, FakeEngine]:
    return {name: FakeEngine(tokenizer, name) for name in names}


def text(value: str) -> Prompt:
    return Prompt(encode=lambda tokenizer: tokenizer.encode(value), text=lambda tokenizer: value)


def complete(client: TestClient, prompt: str, model: str | None = "draft", headers: dict | None = None):
    body = {"prompt": prompt, "max_tokens": 3} | ({"model": model} if model else {})
    return client.post("/v1/completions", json=body, headers=headers or {})


def samples(client: TestClient) -> dict[str, float]:
    return metric_samples(client.get("/metrics").text)


def test_models_by_name(tokenizer):
    fakes = engines(tokenizer, "draft", "small")
    client = TestClient(build_app(Router(fakes), None))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["draft", "small"]
    assert client.get("/v1/models/small").json()["id"] == "small"
    for model in ("draft", "small", None):
        response = complete(client, "Once upon a time", model)
        answered = model or "draft"  # no model: the first one
        assert response.status_code == 200 and response.json()["model"] == answered
        assert response.headers["x-optkit-model"] == answered
        assert response.headers["x-optkit-route"] == ("model" if model else "default")
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "small", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.json()["model"] == "small" and len(fakes["small"].finished) == 2 and len(fakes["draft"].finished) == 2
    missing = complete(client, "hi", "large")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "the model 'large' does not exist: this server serves 'draft', 'small'"
    metrics = samples(client)
    assert metrics['optkit:routed_requests_total{model="small",reason="model"}'] == 2
    assert metrics['optkit:routed_requests_total{model="draft",reason="default"}'] == 1
    assert metrics['optkit:model_generation_tokens_total{model="small"}'] == 6
    assert metrics["optkit:generation_tokens_total"] == 12  # the engines' stats, added up
    assert client.get("/v1/optkit/shadow").status_code == 404


def test_tiered_rules_and_header(tokenizer):
    options = ServeOptions(
        models={"draft": {"path": "draft"}, "small": {"path": "small"}},
        route="tiered",
        tiers={"default": "draft", "rules": [{"name": "long", "min_prompt_tokens": 40}, {"regex": "(?i)prove"}]},
    )
    client = TestClient(build_app(Router(engines(tokenizer, "draft", "small"), options), None))

    def answered(prompt: str, model: str | None = "draft", headers: dict | None = None) -> tuple[str, str]:
        response = complete(client, prompt, model, headers)
        assert response.status_code == 200, response.text
        return response.headers["x-optkit-model"], response.headers["x-optkit-route"]

    assert answered("Once upon a time") == ("draft", "tier")
    assert answered("Once upon a time", None) == ("draft", "default")
    assert answered(LONG) == ("small", "rule:long")
    assert answered("Prove that 2 + 2 = 4") == ("small", "rule:regex")
    assert answered("hi", "small") == ("small", "tier")
    assert answered(LONG, headers={"x-optkit-tier": "draft"}) == ("draft", "header")
    bad = complete(client, "hi", headers={"x-optkit-tier": "huge"})
    assert bad.status_code == 400 and "x-optkit-tier 'huge' is not a tier: use one of draft, small" in bad.text
    assert samples(client)['optkit:routed_requests_total{model="small",reason="rule:long"}'] == 1


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_spill_over_to_another_model_of_the_task(tokenizer):
    clock = Clock()
    options = ServeOptions(
        models={"draft": {"path": "draft"}, "small": {"path": "small"}, "other": {"path": "x", "task": "code"}},
        route="tiered",
        tiers={"order": ["draft", "small", "other"]},
        spill_over={"max_queue_wait_s": 1.0},
    )
    load = LoadTracker(["draft", "small", "other"], window_s=5.0, clock=clock)
    router = Router(engines(tokenizer, "draft", "small", "other"), options, load=load)
    assert router.route("draft", {}, text("hi")).name == "draft"
    stuck = load.start("draft")
    clock.now = 2.0  # draft's oldest request has waited 2 s for its first token
    route = router.route("draft", {}, text("hi"))
    assert (route.name, route.reason) == ("small", "spill")
    busy = load.start("small")
    clock.now = 4.0  # both wait longer than the bound: stay (other serves another task)
    assert router.route("draft", {}, text("hi")).name == "draft"
    load.first_output(stuck), load.first_output(busy)
    clock.now = 10.0  # the waits seen are older than window_s
    assert router.route("draft", {}, text("hi")).reason == "tier"


def test_prefix_affinity(tokenizer):
    options = ServeOptions(
        models={"a": {"path": "small", "task": "small"}, "b": {"path": "small", "task": "small"}},
        route="prefix",
        prefix={"min_tokens": 32},
    )
    router = Router(engines(tokenizer, "a", "b"), options)
    first = router.route("small", {}, text(LONG + "What is next?"))  # a task's name stands for its models
    assert (first.name, first.reason) == ("a", "balance")
    ticket = router.load.start("a")  # a is busy now
    assert router.route("small", {}, text("A different prompt")).name == "b"
    again = router.route("b", {}, text(LONG + "Something else"))
    assert (again.name, again.reason) == ("a", "prefix")  # the shared 48 tokens are cached on a
    router.load.finish(ticket)


def test_fallback_routes_to_full_and_replays_are_queued(tokenizer):
    options = ServeOptions(
        models={"q": {"path": "x"}, "f": {"path": "small"}},
        shadow={"pairs": {"q": "f"}, "rate": 1.0, "idle_s": 0.0},
        fallback={"threshold": {"kld": 0.1}, "window": 2},
    )
    fakes = engines(tokenizer, "q", "f")
    jobs = []

    def score(job, pause) -> ShadowScore:
        jobs.append(job)
        return ShadowScore(num_tokens=3, kld_sum=3.0, top1_matches=1, nll_full_sum=3.0, nll_quant_sum=4.0)

    monitors = {"q": FallbackMonitor("q", "f", options.fallback)}
    load = LoadTracker(["q", "f"])
    shadow = ShadowService(options.shadow, score, load.idle_for, monitors)
    router = Router(fakes, options, shadow=shadow, fallbacks=monitors, load=load)
    with TestClient(build_app(router, None, shutdown_engine=True)) as client:
        prompt_ids = tokenizer.encode("Once upon a time")
        for _ in range(2):
            assert complete(client, "Once upon a time", "q").headers["x-optkit-model"] == "q"
            assert shadow.drain(timeout=10)
        assert jobs[0].token_ids == prompt_ids + fakes["q"].expected_ids(prompt_ids, 3)
        assert jobs[0].num_prompt_tokens == len(prompt_ids) and jobs[0].answered_by == "q"
        response = complete(client, "Once upon a time", "q")
        assert response.status_code == 200 and response.json()["model"] == "f"
        assert response.headers["x-optkit-route"] == "fallback"
        assert shadow.drain(timeout=10) and jobs[-1].answered_by == "f"  # still measured while in fallback
        metrics = samples(client)
        assert metrics['optkit:fallback_active{full="f",quant="q"}'] == 1
        assert metrics['optkit:fallback_switches_total{full="f",quant="q",to="full"}'] == 1
        assert metrics['optkit:shadow_replays_total{full="f",outcome="scored",quant="q"}'] == 3
        assert metrics['optkit:shadow_kld_mean{full="f",quant="q",window="all"}'] == 1.0
        assert metrics['optkit:shadow_tokens_total{full="f",quant="q"}'] == 9
        view = client.get("/v1/optkit/shadow").json()["pairs"][0]
        assert view["scored"] == 3 and view["window"]["kld_mean"] == 1.0 and view["fallback"]["active"]
        assert [r["answered_by"] for r in view["requests"]] == ["q", "q", "f"]
        assert client.post("/v1/optkit/fallback/reset", json={"model": "f"}).status_code == 404
        reset = client.post("/v1/optkit/fallback/reset").json()
        assert reset["reset"] == ["q"] and not reset["pairs"][0]["active"]
        assert complete(client, "Once upon a time", "q").headers["x-optkit-model"] == "q"
        assert samples(client)['optkit:fallback_switches_total{full="f",quant="q",to="quant"}'] == 1
    assert all(fake.shut_down for fake in fakes.values())
