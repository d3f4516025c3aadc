"""Speculative decoding at the server: the per-request opt-out reaches the engine, /metrics shows
the proposer's acceptance (and nothing when speculation is off)."""

import dataclasses

from starlette.testclient import TestClient

from optkit.server.app import build_app
from tests.metrics_text import metric_samples
from tests.server.fake_engine import FakeEngine


class SpeculatingEngine(FakeEngine):
    def stats(self):
        return dataclasses.replace(
            super().stats(),
            spec_proposer="ngram",
            num_spec_steps=10,
            num_spec_draft_tokens=40,
            num_spec_accepted_tokens=30,
            spec_acceptance_rate=0.75,
            spec_mean_accepted_tokens=3.0,
        )


def samples(client: TestClient) -> dict[str, float]:
    return metric_samples(client.get("/metrics").text)


def test_spec_metrics_by_proposer(tokenizer):
    client = TestClient(build_app(SpeculatingEngine(tokenizer), api_key=None))
    got = samples(client)
    assert got['optkit:spec_decode_num_draft_tokens_total{proposer="ngram"}'] == 40
    assert got['optkit:spec_decode_num_accepted_tokens_total{proposer="ngram"}'] == 30
    assert got['optkit:spec_decode_num_steps_total{proposer="ngram"}'] == 10
    assert got['optkit:spec_decode_acceptance_rate{proposer="ngram"}'] == 0.75
    assert got['optkit:spec_decode_mean_accepted_tokens{proposer="ngram"}'] == 3.0


def test_no_spec_samples_when_off(tokenizer):
    client = TestClient(build_app(FakeEngine(tokenizer), api_key=None))
    assert not [name for name in samples(client) if name.startswith("optkit:spec_decode")]


def test_a_request_opts_out(tokenizer):
    engine = FakeEngine(tokenizer)
    client = TestClient(build_app(engine, api_key=None))
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "speculative": False}).is_success
    assert client.post("/v1/completions", json={"prompt": "ho", "max_tokens": 2}).is_success
    assert [params.speculative for _, params in engine.requests.values()] == [False, True]
    refused = client.post("/v1/completions", json={"prompt": "hi", "speculative": "no"})
    assert refused.status_code == 400 and "speculative" in refused.text
