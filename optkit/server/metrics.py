"""Prometheus metrics for /metrics, in a registry of the app's own (never the process-wide one).

Observed by the server, per request:
- `optkit:time_to_first_token_seconds` (histogram): from arrival to the first output token.
- `optkit:time_per_output_token_seconds` (histogram): one observation per request of two or more
  tokens, the mean gap between its output tokens after the first.
- `optkit:e2e_request_latency_seconds` (histogram): from arrival to the last output.
- `optkit:request_success_total{finish_reason}` (counter): finished requests by reason, `stop`,
  `length`, or `abort` for a client that went away. Requests refused (QueueFull, a bad prompt)
  are not counted.

Read from `engine.stats()` at scrape time:
- `optkit:num_requests_running`, `optkit:num_requests_waiting` (gauges).
- `optkit:kv_cache_usage_perc` (gauge): the fraction of KV blocks in use, 0..1;
  `optkit:num_kv_blocks` (gauge): how many blocks there are; `optkit:kv_cache_bytes_per_token`
  (gauge): the bytes one token takes in the KV cache, K and V of every layer (half with an 8-bit
  `--kv-cache-dtype`, plus its scales).
- `optkit:prompt_tokens_total`, `optkit:generation_tokens_total`,
  `optkit:prefix_cache_hit_tokens_total`, `optkit:num_preemptions_total` (counters): the engine's
  cumulative totals since it started (prompt tokens received, tokens sampled, prompt tokens
  served from the prefix cache instead of prefilled, sequences preempted).
- With speculative decoding on, labelled by `proposer` (ngram, draft or eagle):
  `optkit:spec_decode_num_draft_tokens_total`, `optkit:spec_decode_num_accepted_tokens_total`,
  `optkit:spec_decode_num_steps_total` (counters: tokens proposed, tokens accepted, sequence
  decode steps that reserved proposals), `optkit:spec_decode_acceptance_rate` and
  `optkit:spec_decode_mean_accepted_tokens` (gauges: accepted / proposed, accepted per step).
"""

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class EngineCollector(Collector):
    """The engine's own numbers, read when Prometheus scrapes."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        yield from self._families(stats)

    def describe(self):
        yield from self._families(None)

    @staticmethod
    def _families(stats):
        def value(name: str) -> float | None:
            return None if stats is None else float(getattr(stats, name))

        gauges = [
            ("optkit:num_requests_running", "Requests running in the engine.", "num_running"),
            ("optkit:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
            ("optkit:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", "kv_cache_usage"),
            ("optkit:num_kv_blocks", "KV cache blocks, in use or free.", "num_kv_blocks"),
            (
                "optkit:kv_cache_bytes_per_token",
                "KV cache bytes one token takes, K and V of every layer (--kv-cache-dtype).",
                "kv_cache_bytes_per_token",
            ),
        ]
        counters = [
            ("optkit:prompt_tokens", "Prompt tokens received.", "num_prompt_tokens"),
            ("optkit:generation_tokens", "Tokens generated.", "num_generation_tokens"),
            ("optkit:prefix_cache_hit_tokens", "Prompt tokens from the prefix cache.", "num_prefix_cache_hit_tokens"),
            ("optkit:num_preemptions", "Sequences preempted (their KV freed and recomputed).", "num_preemptions"),
        ]
        for name, doc, field in gauges:
            yield GaugeMetricFamily(name, doc, value=value(field))
        for name, doc, field in counters:
            yield CounterMetricFamily(name, doc, value=value(field))
        yield from _spec_families(stats)


def _spec_families(stats):
    """Speculative decoding's numbers, labelled by proposer; no samples when it is off."""
    counter, gauge = CounterMetricFamily, GaugeMetricFamily
    families = [
        (counter, "num_draft_tokens", "Tokens proposed.", "num_spec_draft_tokens"),
        (counter, "num_accepted_tokens", "Proposals accepted.", "num_spec_accepted_tokens"),
        (counter, "num_steps", "Decode steps with proposals.", "num_spec_steps"),
        (gauge, "acceptance_rate", "Accepted / proposed.", "spec_acceptance_rate"),
        (gauge, "mean_accepted_tokens", "Accepted per step.", "spec_mean_accepted_tokens"),
    ]
    proposer = getattr(stats, "spec_proposer", None)
    for kind, name, doc, field in families:
        family = kind(f"optkit:spec_decode_{name}", doc, labels=["proposer"])
        if proposer is not None:
            family.add_metric([proposer], float(getattr(stats, field)))
        yield family


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.ttft = Histogram("optkit:time_to_first_token_seconds", "Time to the first output token.",
                              buckets=TTFT_BUCKETS, registry=registry)  # fmt: skip
        self.tpot = Histogram("optkit:time_per_output_token_seconds", "Mean gap between output tokens after the first.",
                              buckets=TPOT_BUCKETS, registry=registry)  # fmt: skip
        self.e2e = Histogram("optkit:e2e_request_latency_seconds", "Time from arrival to the last output.",
                             buckets=E2E_BUCKETS, registry=registry)  # fmt: skip
        self.success = Counter(
            "optkit:request_success", "Finished requests by finish reason.", ["finish_reason"], registry=self.registry
        )
        self.registry.register(EngineCollector(engine))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def track(self, outputs: AsyncIterator) -> AsyncIterator:
        """Pass a request's outputs through, timing them. Closing this closes `outputs` (the engine
        then aborts the request)."""
        start = time.perf_counter()
        first_at = last_at = None
        num_tokens = 0
        finish_reason = None
        refused = False
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    last_at = time.perf_counter()
                    if first_at is None and output.token_ids:
                        first_at = last_at
                        self.ttft.observe(first_at - start)
                    num_tokens = output.num_output_tokens
                    if output.finished:
                        finish_reason = output.finish_reason or "stop"
                    yield output
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except BaseException:
            refused = last_at is None  # QueueFull or a rejected prompt: the request never ran
            raise
        finally:
            if not refused:
                self.e2e.observe(time.perf_counter() - start)
                self.success.labels(finish_reason or "abort").inc()
                if first_at is not None and last_at is not None and num_tokens > 1:
                    self.tpot.observe((last_at - first_at) / (num_tokens - 1))
