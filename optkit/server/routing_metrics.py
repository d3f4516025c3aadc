"""/metrics for several models, shadow scoring and fallback, next to the server's own (server/metrics.py).

Per model (label `model`), read at scrape time:
- `optkit:routed_requests_total{model, reason}`: requests by the model that answered and why it
  was chosen (model, default, tier, header, rule:LABEL, prefix, balance, spill, fallback).
- `optkit:model_requests_running`, `optkit:model_requests_waiting`, `optkit:model_kv_cache_usage_perc`
  (the engine's), `optkit:model_queue_wait_seconds` (the router's estimate, routing/load.py),
  `optkit:model_generation_tokens_total`.
Per shadow pair (labels `quant`, `full`):
- `optkit:shadow_replays_total{outcome}`: replays queued, scored, dropped (queue full), failed.
- `optkit:shadow_tokens_total`, `optkit:shadow_kld_nats_total`, `optkit:shadow_top1_matches_total`,
  `optkit:shadow_nll_full_nats_total`, `optkit:shadow_nll_quant_nats_total`: token-level sums over
  every scored request (rate(kld_nats) / rate(tokens) is the mean KLD over any range).
- `optkit:shadow_kld_mean`, `optkit:shadow_top1_pct`, `optkit:shadow_ppl_ratio` (gauges, label
  `window`: `recent` for the rolling window of /v1/optkit/shadow, `all` since start).
- `optkit:fallback_active` (0/1) and `optkit:fallback_switches_total{to}` (to `full`, back to `quant`).
"""

import math

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from optkit.routing.online import total


class RouterCollector(Collector):
    def __init__(self, router):
        self.router = router

    def collect(self):
        yield from self._models()
        if self.router.shadow is not None:
            yield from self._shadow()

    def describe(self):
        return []  # collected at scrape time only: names depend on the configuration

    def _models(self):
        router = self.router
        routed = CounterMetricFamily(
            "optkit:routed_requests", "Requests by the model that answered and why.", labels=["model", "reason"]
        )
        for (model, reason), count in sorted(router.routed.items()):
            routed.add_metric([model, reason], count)
        yield routed
        families = {
            "num_running": GaugeMetricFamily("optkit:model_requests_running", "Requests running.", labels=["model"]),
            "num_waiting": GaugeMetricFamily("optkit:model_requests_waiting", "Requests waiting.", labels=["model"]),
            "kv_cache_usage": GaugeMetricFamily(
                "optkit:model_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", labels=["model"]
            ),
            "num_generation_tokens": CounterMetricFamily(
                "optkit:model_generation_tokens", "Tokens generated.", labels=["model"]
            ),
        }
        wait = GaugeMetricFamily(
            "optkit:model_queue_wait_seconds", "The router's estimate of the wait for a first token.", labels=["model"]
        )
        for name, engine in router.engines.items():
            stats = engine.stats()
            for field, family in families.items():
                family.add_metric([name], float(getattr(stats, field)))
            wait.add_metric([name], router.load.queue_wait(name))
        yield from families.values()
        yield wait

    def _shadow(self):
        shadow = self.router.shadow
        pair_labels = ["quant", "full"]
        replays = _counter("shadow_replays", "Shadow replays by outcome.", [*pair_labels, "outcome"])
        sums = {
            "num_tokens": _counter("shadow_tokens", "Output tokens scored.", pair_labels),
            "kld_sum": _counter("shadow_kld_nats", "Sum of KL(full || quant) over tokens.", pair_labels),
            "top1_matches": _counter("shadow_top1_matches", "Tokens with the same top token.", pair_labels),
            "nll_full_sum": _counter("shadow_nll_full_nats", "Sum of the full model's NLL.", pair_labels),
            "nll_quant_sum": _counter("shadow_nll_quant_nats", "Sum of the quant model's NLL.", pair_labels),
        }
        window_labels = [*pair_labels, "window"]
        means = {
            "kld_mean": _gauge("shadow_kld_mean", "Mean KL(full || quant), nats.", window_labels),
            "top1_pct": _gauge("shadow_top1_pct", "Percent of tokens with the same top token.", window_labels),
            "ppl_ratio": _gauge("shadow_ppl_ratio", "Perplexity of quant / perplexity of full.", window_labels),
        }
        active = _gauge("fallback_active", "1 while QUANT's requests go to FULL.", pair_labels)
        switches = _counter("fallback_switches", "Fallback switches.", [*pair_labels, "to"])
        with shadow._lock:
            pairs = [(p, p.total, total(s for _, s in p.recent)) for p in shadow.pairs.values()]
        for pair, all_time, recent in pairs:
            key = [pair.quant, pair.full]
            for outcome in ("queued", "scored", "dropped", "failed"):
                replays.add_metric([*key, outcome], getattr(pair, outcome))
            for field, family in sums.items():
                family.add_metric(key, float(getattr(all_time, field)))
            for window, score in (("recent", recent), ("all", all_time)):
                metrics = score.metrics()
                for field, family in means.items():
                    if not math.isnan(metrics[field]):
                        family.add_metric([*key, window], metrics[field])
            monitor = self.router.fallbacks.get(pair.quant)
            if monitor is not None:
                active.add_metric(key, float(monitor.active))
                for to, count in monitor.switches.items():
                    switches.add_metric([*key, to], count)
        yield replays
        yield from sums.values()
        yield from means.values()
        yield active
        yield switches


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(f"optkit:{name}", doc, labels=labels)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"optkit:{name}", doc, labels=labels)
