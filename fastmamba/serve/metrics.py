"""Prometheus metrics of one server (its own registry, so several apps in one process never clash)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("fastmamba_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("fastmamba_prompt_tokens", "prompt tokens received", registry=r)
        self.generation_tokens = Counter("fastmamba_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("fastmamba_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fastmamba_inter_token_latency_seconds", "time between a request's tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("fastmamba_running_requests", "requests holding a slot (prefilling or decoding)", registry=r)
        self.waiting = Gauge("fastmamba_waiting_requests", "requests waiting for a slot", registry=r)
        self.slots_used = Gauge("fastmamba_slots_in_use", "state-cache slots held by requests", registry=r)
        self.slots_total = Gauge("fastmamba_slots_total", "state-cache slots", registry=r)
        self.kv_pages_used = Gauge("fastmamba_kv_pages_in_use", "attention KV pages held (0: no attention layers)",
                                   registry=r)
        self.prefill_tokens = Gauge("fastmamba_prefill_tokens", "prompt tokens run through prefill since start "
                                    "(tokens served by the prefix cache are not)", registry=r)
        self.prefix_hits = Gauge("fastmamba_prefix_cache_hits", "requests that started from a cached prefix since start",
                                 registry=r)
        self.prefix_hit_tokens = Gauge("fastmamba_prefix_cache_hit_tokens", "prompt tokens served from the prefix "
                                       "cache since start", registry=r)
        self.engine_steps = Gauge("fastmamba_engine_steps", "engine steps since start", registry=r)
        self.engine_step_seconds = Gauge("fastmamba_engine_step_seconds", "time inside engine steps since start",
                                         registry=r)
        self.engine_around_seconds = Gauge("fastmamba_engine_around_seconds", "engine-thread time between steps "
                                           "while busy (inbox, events, metrics) since start", registry=r)
        self.engine_prefill_steps = Gauge("fastmamba_engine_prefill_steps", "engine steps that prefilled since start",
                                          registry=r)
        self.engine_prefill_step_seconds = Gauge("fastmamba_engine_prefill_step_seconds",
                                                 "time inside engine steps that prefilled since start", registry=r)
        self.graph_captures = Gauge("fastmamba_engine_graph_captures", "CUDA graphs the engine captured since start "
                                    "(each at its bucket's first use; the steps that capture are slow)", registry=r)
        self.graph_capture_seconds = Gauge("fastmamba_engine_graph_capture_seconds",
                                           "host time spent capturing CUDA graphs since start", registry=r)
        self.prefix_hit_rate = Gauge("fastmamba_prefix_cache_hit_rate",
                                     "prompt tokens served from the prefix cache / prompt tokens", registry=r)
        # speculative decoding (--speculate K): registered only for a speculative engine
        self._r, self.spec = r, None

    def _spec_gauges(self) -> dict:
        r = self._r
        return {
            "max_k": Gauge("fastmamba_spec_max_draft_tokens", "drafts per request per step the engine may verify "
                           "(--speculate K)", registry=r),
            "drafted": Gauge("fastmamba_spec_draft_tokens", "draft tokens proposed since start", registry=r),
            "accepted": Gauge("fastmamba_spec_accepted_tokens", "draft tokens accepted (emitted) since start",
                              registry=r),
            "verify_steps": Gauge("fastmamba_spec_verify_steps", "engine steps that verified drafts since start",
                                  registry=r),
            "plain_steps": Gauge("fastmamba_spec_plain_steps", "decode steps run without drafts since start "
                                 "(the policy's k = 0, or no request had a draft)", registry=r),
            "acceptance": Gauge("fastmamba_spec_acceptance_rate", "accepted / drafted tokens since start", registry=r),
            "tokens_per_step": Gauge("fastmamba_spec_tokens_per_step", "tokens emitted per request per decode step "
                                     "of the speculative engine since start (1 + accepted / request steps)",
                                     registry=r),
            "policy_k": Gauge("fastmamba_spec_policy_k", "drafts per request the speculation policy chose for the "
                              "last step (-1: no policy, K every step)", registry=r),
        }

    def observe_step(self, stats: dict, tokens: int) -> None:
        """A serving-loop report (the worker's ``on_step``): ``tokens`` generated, the engine's gauges."""
        self.generation_tokens.inc(tokens)
        self.observe_engine(stats)

    def observe_engine(self, stats: dict) -> None:
        """Gauges from an engine's bookkeeping (``engine_thread.engine_stats``), after each step."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.slots_total.set(stats["slots_total"])
        self.slots_used.set(stats["slots_used"])
        self.kv_pages_used.set(stats["kv_pages"])
        self.prefill_tokens.set(stats["prefill_tokens"])
        captures = stats.get("graph_captures")
        if captures:
            self.graph_captures.set(captures["count"])
            self.graph_capture_seconds.set(captures["seconds"])
        spec = stats.get("spec")
        if spec:
            self.observe_spec(spec)
        prefix = stats.get("prefix")
        if prefix:
            self.prefix_hits.set(prefix["hits"])
            self.prefix_hit_tokens.set(prefix["hit_tokens"])
            if prefix.get("prompt_tokens"):
                self.prefix_hit_rate.set(prefix["hit_tokens"] / prefix["prompt_tokens"])

    def observe_spec(self, spec: dict) -> None:
        """The speculative counters of ``worker.spec_stats``."""
        if self.spec is None:
            self.spec = self._spec_gauges()
        g = self.spec
        for key in ("max_k", "drafted", "accepted", "verify_steps", "plain_steps"):
            g[key].set(spec[key])
        if spec["drafted"]:
            g["acceptance"].set(spec["accepted"] / spec["drafted"])
        if spec["request_steps"]:
            g["tokens_per_step"].set(1 + spec["accepted"] / spec["request_steps"])
        if not spec.get("policy"):
            g["policy_k"].set(-1)
        elif spec["policy_k"] is not None:  # after the policy's first choice
            g["policy_k"].set(spec["policy_k"])

    def observe_thread(self, timing: dict) -> None:
        self.engine_steps.set(timing["steps"])
        self.engine_step_seconds.set(timing["step_s"])
        self.engine_around_seconds.set(timing["around_s"])
        self.engine_prefill_steps.set(timing.get("prefill_steps", 0))
        self.engine_prefill_step_seconds.set(timing.get("prefill_step_s", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
