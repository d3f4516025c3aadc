"""Acceptance 2: shadow mode's online KLD and same-top-token rate, as /metrics reports them, match
`optkit eval`'s offline numbers (the gate's functions over the HF modules) on the same sequences."""

import pytest
import torch
from starlette.testclient import TestClient

from optkit.quant.formats.load import load_model
from optkit.routing.config import serve_options
from optkit.routing.online import score_sequence, total
from optkit.routing.startup import start_router
from optkit.runtime.engine import EngineConfig
from optkit.server.app import build_app
from tests.metrics_text import metric_samples

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "def fibonacci(n):", "The capital of France", "import numpy as np", "Hello, world"]


def test_online_numbers_match_the_offline_gate(small_w2):
    options = serve_options(
        {
            "models": {"small-w2": {"path": str(small_w2)}, "small": {"path": "small"}},
            "shadow": {"pairs": {"small-w2": "small"}, "rate": 1.0},
        }
    )
    router = start_router(options, EngineConfig(max_num_seqs=8, kv_cache_blocks=256))
    replayed, score = [], router.shadow.score
    router.shadow.score = lambda job, pause: (
        replayed.append((job.token_ids, job.num_prompt_tokens)) or score(job, pause)
    )
    with TestClient(build_app(router, None, shutdown_engine=True)) as client:
        for prompt in PROMPTS:
            body = {"model": "small-w2", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).headers["x-optkit-model"] == "small-w2"
        assert router.shadow.drain(timeout=120)
        metrics = metric_samples(client.get("/metrics").text)
    pair = '{full="small",quant="small-w2"}'
    tokens = metrics[f"optkit:shadow_tokens_total{pair}"]
    online = {
        "kld_mean": metrics[f"optkit:shadow_kld_nats_total{pair}"] / tokens,
        "top1_pct": 100 * metrics[f"optkit:shadow_top1_matches_total{pair}"] / tokens,
    }
    assert metrics['optkit:shadow_kld_mean{full="small",quant="small-w2",window="all"}'] == pytest.approx(
        online["kld_mean"]
    )
    assert len(replayed) == len(PROMPTS) and tokens == 24 * len(PROMPTS)

    full, quant = load_model("small"), load_model(small_w2)
    with torch.inference_mode():
        offline = total(
            score_sequence(full(torch.tensor([ids])).logits[0], quant(torch.tensor([ids])).logits[0], ids, n)
            for ids, n in replayed
        ).metrics()
    print(f"online {online}, offline kld_mean {offline['kld_mean']:.5f} top1_pct {offline['top1_pct']:.3f}")
    assert offline["kld_mean"] > 0.01 and offline["top1_pct"] < 99  # 2 bits: a real difference to measure
    for key in ("kld_mean", "top1_pct"):
        assert online[key] == pytest.approx(offline[key], rel=0.10)  # acceptance: within 10%
        # in fact the same numbers, up to float32 summation order: the runtime's CPU kernels sum in another
        # order on AVX2 than on AVX-512 (1.8e-3 apart on AVX2 for this 2-bit model, under 1e-3 on AVX-512)
        assert online[key] == pytest.approx(offline[key], rel=5e-3)
