"""Prometheus metrics of a served engine: the engine's state read at scrape time, and
per-request latency histograms observed as requests finish. Per-tenant counters (tenant:
the API key's position, "key-0", ...; "default" without keys) count each tenant's requests,
prompt tokens and prefix-cache hits: with keys, a tenant's hits come from its own prompts
only."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _EngineCollector:
    """Reads `stats()` (an EngineStats) when Prometheus scrapes."""

    def __init__(self, stats, model_name: str):
        self.stats, self.labels = stats, {"model_name": model_name}

    def _gauge(self, name, doc, value):
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name, doc, value):
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self):
        s = self.stats()
        yield self._gauge("hf_paged_num_requests_running", "Sequences running.", s.running)
        yield self._gauge("hf_paged_num_requests_waiting", "Sequences waiting to start.", s.waiting)
        yield self._gauge("hf_paged_num_requests_swapped",
                          "Sequences preempted to the CPU pool.", s.swapped)
        yield self._gauge("hf_paged_kv_blocks_used", "KV blocks held by sequences.", s.blocks_used)
        yield self._gauge("hf_paged_kv_blocks_cached",
                          "KV blocks kept by the prefix cache, held by no sequence.", s.blocks_cached)
        yield self._gauge("hf_paged_kv_blocks_free", "Free KV blocks.", s.blocks_free)
        yield self._gauge("hf_paged_kv_usage_ratio", "Fraction of KV blocks in use.", s.kv_usage)
        yield self._gauge("hf_paged_prefix_cache_hit_rate",
                          "Prompt tokens found in the prefix cache / prompt tokens looked up.",
                          s.prefix_cache_hit_rate)
        yield self._counter("hf_paged_num_preemptions", "Preemptions.", s.num_preemptions)
        yield self._counter("hf_paged_recomputed_tokens",
                            "Tokens computed again after preemptions by recompute.",
                            s.recomputed_tokens)
        yield self._counter("hf_paged_prompt_tokens", "Prompt tokens computed.", s.prompt_tokens)
        yield self._counter("hf_paged_generation_tokens", "Tokens generated.",
                            s.generation_tokens)
        yield self._counter("hf_paged_prefix_cache_hit_tokens",
                            "Prompt tokens served from the prefix cache.",
                            s.prefix_cache_hit_tokens)
        yield self._counter("hf_paged_spec_decode_num_draft_tokens",
                            "Speculative decoding: draft tokens verified.",
                            s.spec_proposed_tokens)
        yield self._counter("hf_paged_spec_decode_num_accepted_tokens",
                            "Speculative decoding: draft tokens accepted.",
                            s.spec_accepted_tokens)
        yield self._counter("hf_paged_spec_decode_num_drafts",
                            "Speculative decoding: (sequence, step) verifications.",
                            s.spec_verifications)
        yield self._gauge("hf_paged_spec_decode_acceptance_rate",
                          "Draft tokens accepted / draft tokens verified.",
                          s.spec_acceptance_rate)
        yield self._gauge("hf_paged_spec_decode_mean_accepted_length",
                          "Tokens per speculating sequence and step (accepted drafts + 1).",
                          s.spec_mean_accepted_length)


class ServerMetrics:
    """The registry behind /metrics."""

    def __init__(self, stats, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name))
        labels = ["model_name"]
        self.model_name = model_name
        self.requests = Counter("hf_paged_requests", "Finished requests by finish reason.",
                                labels + ["finish_reason"], registry=self.registry)
        self.ttft = Histogram("hf_paged_time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("hf_paged_time_per_output_token_seconds",
                              "Time per generated token after the first.", labels,
                              buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("hf_paged_e2e_request_latency_seconds",
                             "Time from arrival to the last token.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.rejected = Counter("hf_paged_requests_rejected",
                                "Requests refused at admission (more sequences than may "
                                "wait, too long for the context or the pool, or the server "
                                "busy), by HTTP status.",
                                labels + ["status"], registry=self.registry)
        tenant = labels + ["tenant"]
        self.tenant_requests = Counter("hf_paged_tenant_requests",
                                       "Finished requests per tenant.", tenant,
                                       registry=self.registry)
        self.tenant_prompt_tokens = Counter("hf_paged_tenant_prompt_tokens",
                                            "Prompt tokens per tenant.", tenant,
                                            registry=self.registry)
        self.tenant_hits = Counter("hf_paged_tenant_prefix_cache_hit_tokens",
                                   "Prompt tokens served from the prefix cache, per tenant.",
                                   tenant, registry=self.registry)

    def finished(self, out: RequestOutput, tenant: str = "default") -> None:
        m = out.metrics
        for c in out.outputs:
            self.requests.labels(self.model_name, c.finish_reason or "unknown").inc()
        self.tenant_requests.labels(self.model_name, tenant).inc()
        self.tenant_prompt_tokens.labels(self.model_name, tenant).inc(len(out.prompt_token_ids))
        self.tenant_hits.labels(self.model_name, tenant).inc(out.num_cached_tokens)
        if m is None or m.finished_time is None:
            return
        self.e2e.labels(self.model_name).observe(m.finished_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.labels(self.model_name).observe(m.first_token_time - m.arrival_time)
            tokens = max(len(c.token_ids) for c in out.outputs)
            if tokens > 1:
                self.tpot.labels(self.model_name).observe(
                    (m.finished_time - m.first_token_time) / (tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
