"""Prometheus metrics in vLLM's style under ``vericache_`` (one registry per app, no globals): the
metric set, the sink that turns the engine's events (``BackgroundService`` metrics) into them, and the
gauges read at scrape time. The gateway and the verifier role both export these."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, model: str, mode: str, compressor: str) -> None:
        # Long: one declaration per metric, read as the list of what /metrics exports
        self.registry = r = CollectorRegistry()
        self.link_counted: dict[str, tuple[float, float]] = {}   # link -> (bytes, busy s) already counted
        self.labels = {"model": model, "mode": mode, "compressor": compressor}
        names = list(self.labels)

        def g(name, doc, extra=()):
            return Gauge(f"vericache_{name}", doc, names + list(extra), registry=r)

        def c(name, doc, extra=()):
            return Counter(f"vericache_{name}", doc, names + list(extra), registry=r)

        def h(name, doc, buckets=LATENCY_BUCKETS, extra=()):
            return Histogram(f"vericache_{name}", doc, names + list(extra), buckets=buckets, registry=r)

        self.running = g("num_requests_running", "Requests being prefilled, drafted, verified or decoded")
        self.waiting = g("num_requests_waiting", "Requests waiting for device memory")
        self.kv_bytes = g("kv_cache_bytes", "KV bytes held, by tier", ["tier"])
        self.kv_usage = g("kv_cache_usage_perc", "Share of the device KV budget in use (0-1)")
        self.weight_bytes = g("model_weight_bytes", "Bytes of model weights resident (GGUF blocks as stored)")
        self.drafts = c("spec_decode_num_drafts", "Verification rounds")
        self.draft_tokens = c("spec_decode_num_draft_tokens", "Drafted tokens")
        self.accepted_tokens = c("spec_decode_num_accepted_tokens", "Accepted draft tokens")
        self.accepted_per_pos = c("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens by draft position",
                                  ["position"])
        self.full_step_tokens = c("full_step_tokens", "Tokens VeriCache requests decoded by plain full-KV steps "
                                  "(their drafts would not have paid, or a cool-down)")
        self.guided_swaps = c("guided_swaps", "Tokens verification-guided selection traded into drafters' "
                              "compressed stores (all layers and KV heads; per round: over spec_decode_num_drafts)")
        self.lookup_proposed = c("lookup_proposed_tokens", "Prompt-lookup proposal tokens drafters checked")
        self.lookup_kept = c("lookup_kept_tokens", "Prompt-lookup proposal tokens drafters agreed with (kept as drafts)")
        self.acceptance_length = h("acceptance_length", "Tokens emitted per verification round",
                                   (1, 2, 4, 8, 12, 16, 24, 32, 48, 64))
        self.link_bytes = c("link_bytes", "Bytes moved by the host-to-device link", ["link"])
        self.link_busy = c("link_busy_seconds", "Seconds the link was busy", ["link"])
        self.busy = c("engine_busy_seconds", "Seconds the engine spent in forwards (its rate: the busy share)")
        self.draft_step = h("draft_step_seconds", "Draft step latency")
        self.verify_step = h("verify_step_seconds", "Verification forward latency")
        self.ttft = h("time_to_first_token_seconds", "Time to first token")
        self.itl = h("inter_token_latency_seconds", "Time between streamed tokens")
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency")
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = c("generation_tokens", "Tokens generated")
        self.success = c("request_success", "Finished requests by reason", ["finished_reason"])
        self.errors = c("request_errors", "Requests answered with an error, by HTTP status", ["status"])
        # remote prefix caching (engine.remote, remote.verifier)
        self.prefix_hits = c("prefix_cache_hits", "Prefix blocks found in the store")
        self.prefix_misses = c("prefix_cache_misses", "Prefix blocks looked up and not found (or corrupt)")
        self.prefix_bytes = c("prefix_fetch_bytes", "Bytes fetched from the prefix store, by link and KV tier",
                              ["link", "tier"])
        self.prefix_fetch = h("prefix_fetch_seconds", "Seconds to fetch a prompt's stored blocks", extra=["link"])
        self.store_errors = c("prefix_store_errors", "Prefix store unreachable (the prompt was recomputed)")
        self.verifier_rtt = h("verifier_rtt_seconds", "Round trip of a draft to the remote verifier and back")
        self.verifier_failovers = c("verifier_failovers", "Sessions moved to the next verifier of a pool after theirs "
                                    "stopped answering (the output unchanged)")
        for metric in (self.prefix_hits, self.prefix_misses, self.store_errors, self.verifier_rtt, self.verifier_failovers,
                       self.full_step_tokens, self.guided_swaps, self.lookup_proposed, self.lookup_kept):
            self.lab(metric)  # exported (as zero) before the first event, so dashboards show them
        for kind in ("emulated", "pcie"):   # zero while the full KV is not tiered (the CPU's default)
            self.lab(self.link_bytes, link=kind)
            self.lab(self.link_busy, link=kind)
        for link in ("local", "slow", "fast"):
            self.lab(self.prefix_fetch, link=link)
            for tier in ("full", "compressed"):
                self.lab(self.prefix_bytes, link=link, tier=tier)

    def lab(self, metric, **extra):
        """The metric's child for the server's labels, overridden by ``extra`` (a request's mode, say)."""
        return metric.labels(**{**self.labels, **extra})


def metrics_sink(m: Metrics):
    def sink(event: str, f: dict) -> None:
        labels = {k: f[k] for k in ("mode", "compressor") if k in f}  # the request's own, when known
        if event == "request_done":
            m.lab(m.success, finished_reason=str(f.get("finish_reason")), **labels).inc()
            m.lab(m.e2e, **labels).observe(f["e2e_s"])
        elif event == "round" and f["drafted"] == 0:      # a plain full step: not a verification round
            m.lab(m.full_step_tokens, **labels).inc()
        elif event == "round":
            m.lab(m.drafts, **labels).inc()
            m.lab(m.draft_tokens, **labels).inc(f["drafted"])
            m.lab(m.accepted_tokens, **labels).inc(f["accepted"])
            for pos in range(f["accepted"]):
                m.lab(m.accepted_per_pos, position=str(pos), **labels).inc()
            m.lab(m.acceptance_length, **labels).observe(f["accepted"] + 1)
            for metric, key in ((m.guided_swaps, "swapped"), (m.lookup_proposed, "proposed"), (m.lookup_kept, "kept")):
                if f.get(key):
                    m.lab(metric, **labels).inc(f[key])
        elif event == "phase":
            m.lab(m.busy).inc(f["seconds"])
            if "draft" in f["kind"] or "verify" in f["kind"]:
                # one forward per step: a step with a verification counts as a verify step
                m.lab(m.verify_step if "verify" in f["kind"] else m.draft_step).observe(f["seconds"])
        elif event in ("verify_step", "prefill"):  # the verifier role's own forwards
            if event == "verify_step":
                m.lab(m.verify_step).observe(f["seconds"])
            if event == "prefill" or not f.get("with_prefill"):   # a shared forward counts once
                m.lab(m.busy).inc(f["seconds"])
        elif event == "prefix":
            m.lab(m.prefix_hits).inc(f["hit_blocks"])
            m.lab(m.prefix_misses).inc(f["miss_blocks"])
            m.lab(m.prefix_bytes, link=f["link"], tier=f["tier"]).inc(f["bytes"])
            m.lab(m.prefix_fetch, link=f["link"]).observe(f["seconds"])
        elif event == "store_error":
            m.lab(m.store_errors).inc()
        elif event == "verifier_rtt":
            m.lab(m.verifier_rtt).observe(f["seconds"])
        elif event == "verifier_failover":
            m.lab(m.verifier_failovers).inc()
    return sink


def refresh_gauges(g: dict, m: Metrics) -> None:
    """Engine-side gauges at scrape time (a Triton backend has its own /metrics and reports none here)."""
    if not g:
        return
    m.lab(m.running).set(g["running"])
    m.lab(m.waiting).set(g["waiting"])
    m.lab(m.kv_bytes, tier="device").set(g["kv_device"])
    m.lab(m.kv_bytes, tier="host").set(g["kv_host"])
    m.lab(m.kv_usage).set(g["kv_usage"])
    if g.get("weight_bytes") is not None:
        m.lab(m.weight_bytes).set(g["weight_bytes"])
    if g["link"] is not None:
        kind, moved, busy = g["link"]
        bytes_c, busy_c = m.lab(m.link_bytes, link=kind), m.lab(m.link_busy, link=kind)
        counted_bytes, counted_busy = m.link_counted.get(kind, (0.0, 0.0))   # counters follow the link's totals
        bytes_c.inc(max(moved - counted_bytes, 0))
        busy_c.inc(max(busy - counted_busy, 0))
        m.link_counted[kind] = (max(moved, counted_bytes), max(busy, counted_busy))
