"""`optkit serve` with several models as a real process, driven by the official `openai` client:
acceptance 1 (two models by name, tiered escalation) and 3 (fallback under load)."""

import threading
import time

import pytest
import yaml

from tests.metrics_text import metric_samples
from tests.serve_process import httpx, serving

pytestmark = pytest.mark.slow


def client(base: str):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(base: str) -> dict[str, float]:
    return metric_samples(httpx.get(f"{base}/metrics", timeout=10).text)


def test_two_models_by_name_and_tiered_escalation(tmp_path):
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(
        yaml.safe_dump({"order": ["draft", "small"], "rules": [{"name": "long", "min_prompt_tokens": 64}]})
    )
    args = ["--model", "draft=draft", "--model", "small=small", "--route", "tiered", "--tiers", str(tiers)]
    with serving(tmp_path, *args, "--kv-cache-fraction", "draft=0.2", "--kv-cache-blocks", "small=256") as (base, log):
        assert "serving draft, small; route tiered on" in log.read_text()
        openai_client = client(base)
        assert [m.id for m in openai_client.models.list().data] == ["draft", "small"]

        def answer(model: str, prompt: str) -> tuple[str, str, str]:
            raw = openai_client.completions.with_raw_response.create(
                model=model, prompt=prompt, max_tokens=6, temperature=0
            )
            completion = raw.parse()
            assert completion.choices[0].text
            return completion.model, raw.headers["x-optkit-model"], raw.headers["x-optkit-route"]

        assert answer("draft", "Once upon a time") == ("draft", "draft", "tier")
        assert answer("small", "Once upon a time") == ("small", "small", "tier")
        long_prompt = "def add(a, b):\n    return a + b\n\n" * 8  # over 64 tokens
        assert answer("draft", long_prompt) == ("small", "small", "rule:long")
        chat = openai_client.chat.completions.create(
            model="small", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert chat.model == "small"
        samples = metrics(base)
        assert samples['optkit:routed_requests_total{model="small",reason="rule:long"}'] == 1
        assert samples['optkit:routed_requests_total{model="draft",reason="tier"}'] == 1
        assert samples['optkit:model_generation_tokens_total{model="small"}'] >= 12
        assert samples["optkit:num_requests_running"] == 0


def test_fallback_switches_under_load_without_failing_a_request(tmp_path, draft_w2):
    recipe = tmp_path / "serve.yaml"
    serve = {
        "models": {"draft-w2": {"path": str(draft_w2)}, "draft": {"path": "draft"}},
        "shadow": {"pairs": {"draft-w2": "draft"}, "rate": 1.0, "idle_s": 0.0, "max_defer_s": 0.1},
        "fallback": {"threshold": {"kld": 0.05}, "window": 10},
    }
    recipe.write_text(yaml.safe_dump({"serve": serve}))
    window = 3
    with serving(tmp_path, "--recipe", str(recipe), "--fallback-window", str(window)) as (base, log):
        answered: list[tuple[float, str, str]] = []
        failures: list[BaseException] = []
        stop = threading.Event()

        def loop(worker: int) -> None:
            openai_client = client(base)
            i = 0
            while not stop.is_set():
                try:
                    raw = openai_client.completions.with_raw_response.create(
                        model="draft-w2", prompt=f"Request {worker}.{i}: once upon a time", max_tokens=8, temperature=0
                    )
                    assert raw.parse().choices[0].finish_reason in ("stop", "length")
                    answered.append((time.time(), raw.headers["x-optkit-model"], raw.headers["x-optkit-route"]))
                except BaseException as e:  # every failure is the test's business
                    failures.append(e)
                i += 1

        workers = [threading.Thread(target=loop, args=(w,)) for w in range(4)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 120
        while sum(model == "draft" for _, model, _ in answered) < 8 and time.monotonic() < deadline and not failures:
            time.sleep(0.1)
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
        assert not failures, failures[:3]
        fallback_routed = [reason for _, model, reason in answered if model == "draft"]
        assert len(fallback_routed) >= 8 and set(fallback_routed) == {"fallback"}

        state = httpx.get(f"{base}/v1/optkit/shadow", timeout=10).json()["pairs"][0]
        [event] = state["fallback"]["events"]
        assert event["to"] == "full" and f"over the last {window} shadowed requests" in event["reason"]
        scored_before = [r for r in state["requests"] if r["scored_at"] <= event["at"]]
        assert len(scored_before) == window  # it switched on the first full window
        samples = metrics(base)
        assert samples['optkit:fallback_active{full="draft",quant="draft-w2"}'] == 1
        assert samples['optkit:fallback_switches_total{full="draft",quant="draft-w2",to="full"}'] == 1
        assert samples['optkit:routed_requests_total{model="draft",reason="fallback"}'] >= 8
        assert "fallback: requests for draft-w2 now go draft-w2 -> draft" in log.read_text()

        reset = httpx.post(f"{base}/v1/optkit/fallback/reset", json={"model": "draft-w2"}, timeout=10).json()
        assert reset["reset"] == ["draft-w2"]
        assert (
            client(base)
            .completions.with_raw_response.create(model="draft-w2", prompt="hi", max_tokens=2)
            .headers["x-optkit-model"]
            == "draft-w2"
        )
