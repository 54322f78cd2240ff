"""The router's Prometheus metrics (names from :mod:`disagg.api.metrics`), one registry per router."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily

from disagg.api import metrics as m

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (1, 8, 32, 128, 512, 2048, 8192, 32768, 131072)
ROUTING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3)
# the picker's decision includes parsing and tokenizing the body: a long prompt on a busy core takes
# milliseconds, and its tail must show (bench/picker_vs_reference_epp.py saw over 1% above 5 ms)
PICKER_BUCKETS = (*ROUTING_BUCKETS[:-1], 2e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class LoopHistogram:
    """A histogram observed only from the router's event loop (one thread), so without locks: a bisect and
    two additions per observation. prometheus_client's Histogram takes a lock for the bucket and another for
    the sum on every observation; the inter-token latency is observed once per token, and at 1,000 streams
    that was ~6% of the router's samples (py-spy, bench/router_vs_vllm_router.py). Read at scrape time, in
    the same loop. Same exposition as prometheus_client's (buckets, _sum, _count), no labels."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self._bounds = [float(b) for b in buckets]
        self._counts = [0] * (len(self._bounds) + 1)     # the last: above every bound (+Inf only)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        # Prometheus buckets count values <= their bound: the first bound >= value
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, self._bounds), "+Inf"], self._counts):
            cumulative += n
            buckets.append((bound, cumulative))
        family.add_metric([], buckets, self._sum)
        return [family]


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(m.ROUTER_TTFT_SECONDS, "Time to first token of streamed requests, as the client sees it: "
                              "from its arrival at the router, admission wait included (a non-streaming answer "
                              "shows no first token; its duration is the request's).",
                              ["path"], buckets=LATENCY_BUCKETS, registry=r)
        # once per token: the lock-free histogram (LoopHistogram)
        self.itl = LoopHistogram(m.ROUTER_ITL_SECONDS, "Time between streamed tokens.", LATENCY_BUCKETS, r)
        self.e2e = Histogram(m.ROUTER_E2E_SECONDS, "Request duration, from its arrival at the router.", ["path"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.input_tokens = Histogram(m.ROUTER_INPUT_TOKENS, "Prompt tokens per request.",
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram(m.ROUTER_OUTPUT_TOKENS, "Generated tokens per request.",
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.requests = Counter(m.ROUTER_REQUESTS, "Requests by outcome and path.", ["outcome", "path"],
                                registry=r)
        self.fallbacks = Counter(m.ROUTER_FALLBACKS, "Fallbacks taken, by reason.", ["reason"], registry=r)
        self.pairing_refusals = Counter(m.ROUTER_PAIRING_REFUSALS, "Requests whose decode was not paired with a "
                                        "healthy prefill because it was of another KV revision, by reason.",
                                        ["reason"], registry=r)
        self.decisions = Counter(m.ROUTER_ROUTING_DECISIONS, "Routing decisions.", ["policy", "role", "worker"],
                                 registry=r)
        self.load_bounded = Counter(m.ROUTER_LOAD_BOUNDED, "Decisions where the worker holding the most of the "
                                    "prompt was passed over because of the load-skew bound.", ["role"], registry=r)
        self.routing_seconds = Histogram(m.ROUTER_ROUTING_SECONDS, "Time to pick a worker (no tokenization).",
                                         ["policy", "role"], buckets=ROUTING_BUCKETS, registry=r)
        self.picker_decision = Histogram(m.ROUTER_PICKER_DECISION_SECONDS, "Picker mode: time from a request's "
                                         "body to its destination (parse, tokenize, plan; a prefill's wait is "
                                         "not in it).", ["kind"], buckets=PICKER_BUCKETS, registry=r)
        self.picker_streams = Gauge(m.ROUTER_PICKER_STREAMS, "Picker mode: the gateway's ext_proc streams open.",
                                    registry=r)
        self.prompt_tokens = Counter(m.ROUTER_PROMPT_TOKENS, "Prompt tokens routed.", registry=r)
        self.cached_prompt_tokens = Counter(m.ROUTER_CACHED_PROMPT_TOKENS,
                                            "Prompt tokens the chosen prefilling worker already held.",
                                            registry=r)
        self.active = Gauge(m.ROUTER_ACTIVE_REQUESTS, "Requests in flight per worker.", ["role", "worker"],
                            registry=r)
        self.workers = Gauge(m.ROUTER_WORKERS, "Known workers.", ["role", "state"], registry=r)
        self.indexed_blocks = Gauge(m.ROUTER_INDEXED_BLOCKS, "Blocks in the prefix index.", ["role"],
                                    registry=r)
        self.kv_event_batches = Counter(m.ROUTER_KV_EVENT_BATCHES, "KV event batches applied.", registry=r)
        self.kv_index_resyncs = Counter(m.ROUTER_KV_INDEX_RESYNCS, "Times a worker's prefix-index entries were "
                                        "repaired after KV event batches went missing, by why and how: replayed "
                                        "(exact again) or dropped (rebuilt from what remained).",
                                        ["reason", "outcome"], registry=r)
        self.kv_event_batches_missed = Counter(m.ROUTER_KV_EVENT_BATCHES_MISSED, "KV event batches the router "
                                               "did not receive on the live socket (then replayed, or lost).",
                                               registry=r)
        self.in_flight = Gauge(m.ROUTER_IN_FLIGHT, "Requests admitted and not yet answered in full.", registry=r)
        self.queued = Gauge(m.ROUTER_QUEUE_DEPTH, "Requests waiting for admission.", registry=r)
        # every admitted request, 0 for those admitted at once (the share queued is then readable); a
        # request refused (429) is counted in rejected instead
        self.queue_wait = LoopHistogram(m.ROUTER_QUEUE_WAIT_SECONDS, "Time admitted requests waited for "
                                        "admission (spec.router.maxInFlight), part of their TTFT and duration.",
                                        LATENCY_BUCKETS, r)
        self.rejected = Counter(m.ROUTER_REJECTED, "Requests refused with a 429, by reason.", ["reason"],
                                registry=r)
        for reason in (m.REJECT_QUEUE_FULL, m.REJECT_QUEUE_TIMEOUT):
            # at 0 from the start: a rate (a dashboard, an alert) sees the first rejection, not only the second
            self.rejected.labels(reason)
        self.auth_failures = Counter(m.ROUTER_AUTH_FAILURES, "Requests refused with a 401 (spec.router.auth), "
                                     "by reason: no key, or a key that is not one of the router's.", ["reason"],
                                     registry=r)
        self.api_keys = Gauge(m.ROUTER_API_KEYS, "API keys the router accepts (spec.router.auth), as last read.",
                              registry=r)
        self.migrations = Counter(m.ROUTER_MIGRATIONS, "Decode streams that failed after they began, by what "
                                  "became of them: continued on another worker (migrated), ended by the router "
                                  "after their last token (not_needed), or not continued (exhausted, failed, "
                                  "unsupported).", ["outcome"], registry=r)
        self.flex_workers = Gauge(m.ROUTER_FLEX_WORKERS, "Flex workers by the role they serve, and whether they "
                                  "are draining for a switch (taking no new work).", ["role", "state"], registry=r)
        self.role_switches = Counter(m.ROUTER_ROLE_SWITCHES, "Flex workers' role switches, by how they ended: "
                                     "switched (drained), abandoned (the drain's bound passed; switched anyway), "
                                     "cancelled (asked back before the drain ended).",
                                     ["from_role", "to_role", "outcome"], registry=r)
        self.switch_drain = Histogram(m.ROUTER_SWITCH_DRAIN_SECONDS, "A flex worker's role change seen -> it takes "
                                      "the new role's work (its drain).", ["outcome"],
                                      buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300), registry=r)
        self.kv_held = Gauge(m.ROUTER_KV_HELD, "Hand-offs whose KV a flex worker holds for a decode (not yet "
                             "pulled, lease not run out).", ["role", "worker"], registry=r)
        self.timeouts = Counter(m.ROUTER_TIMEOUTS, "Worker calls cut by a timeout, by which one.", ["kind"],
                                registry=r)
        self.adapter_workers = Gauge(m.ROUTER_ADAPTER_WORKERS, "Workers holding each declared LoRA adapter "
                                     "(spec.model.adapters), by role, as the router loaded or saw it.",
                                     ["adapter", "role"], registry=r)
        self.adapter_loads = Counter(m.ROUTER_ADAPTER_LOADS, "LoRA adapter load and unload calls to workers, by "
                                     "outcome.", ["outcome"], registry=r)

    def kv_resynced(self, reason: str, outcome: str, missed: int) -> None:
        self.kv_index_resyncs.labels(reason, outcome).inc()
        self.kv_event_batches_missed.inc(missed)
