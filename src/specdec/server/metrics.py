"""The server's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..engine import GenerationResult
from ..offers import PRIOR_ALPHA


class ServerMetrics:
    """Prometheus metrics, in a registry of their own (one per app)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "specdec_requests", "requests by endpoint and HTTP status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("specdec_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated = Counter("specdec_generated_tokens", "tokens generated", registry=r)
        lat = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10, 20, 40)
        self.ttft = Histogram(
            "specdec_time_to_first_token_seconds", "request arrival to its first token", buckets=lat, registry=r
        )
        self.itl = Histogram(
            "specdec_inter_token_latency_seconds", "time per token after the first", buckets=lat, registry=r
        )
        self.e2e = Histogram(
            "specdec_request_latency_seconds", "request arrival to its last token", buckets=lat, registry=r
        )
        self.batch = Gauge("specdec_batch_size", "sequences in the running batch", registry=r)
        self.queue = Gauge("specdec_queue_depth", "requests waiting for a place in the batch", registry=r)
        self.drafting = Gauge(
            "specdec_drafting_enabled", "1 while the batch leaves drafting room to pay, else 0", registry=r
        )
        self.steps = Counter("specdec_steps", "engine steps, by whether drafting was on", ["drafting"], registry=r)
        self.drafted = Counter("specdec_draft_tokens", "draft tokens verified, by method", ["method"], registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "draft tokens accepted, by method", ["method"], registry=r)
        self.passes = Counter("specdec_target_passes", "target verification passes, by method", ["method"], registry=r)
        self.pass_tokens = Counter(
            "specdec_pass_tokens", "tokens committed by verification passes, by method", ["method"], registry=r
        )
        self.alpha = Gauge(
            "specdec_acceptance_rate", "accepted / drafted tokens so far, by method", ["method"], registry=r
        )
        self.tau = Gauge(
            "specdec_tokens_per_pass", "tokens per target verification pass so far, by method", ["method"], registry=r
        )
        self.drafting.set(1)
        self._sums: dict[str, list[float]] = {}  # method -> [drafted, accepted, passes, pass tokens]

    def finished(self, method: str, result: GenerationResult) -> None:
        m = result.metrics
        self.prompt_tokens.inc(m.prompt_tokens)
        s = self._sums.setdefault(method, [0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((m.proposed, m.accepted, m.steps, m.step_tokens)):
            s[i] += v
        self.drafted.labels(method).inc(m.proposed)
        self.accepted.labels(method).inc(m.accepted)
        self.passes.labels(method).inc(m.steps)
        self.pass_tokens.labels(method).inc(m.step_tokens)
        if s[0]:
            self.alpha.labels(method).set(s[1] / s[0])
        if s[2]:
            self.tau.labels(method).set(s[3] / s[2])

    def acceptance(self) -> float:
        """Acceptance over every speculative request so far (a prior before there is any)."""
        drafted = sum(s[0] for s in self._sums.values())
        accepted = sum(s[1] for s in self._sums.values())
        return (accepted + PRIOR_ALPHA * 16) / (drafted + 16)
