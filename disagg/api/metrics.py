"""Every Prometheus metric name the project exposes or reads, in one place.

The router and workers expose them, the planner reads them, the dashboards and
alert rules query them: all import these names instead of spelling them out.
Units are base units (seconds, tokens); latencies are histograms.
Add new names here, next to their kin, with the labels they carry.
"""

PREFIX = "disagg_"

# ---- router (labels: deployment, namespace where known)
ROUTER_TTFT_SECONDS = "disagg_router_ttft_seconds"                  # histogram
# the exemplar label of a traced request's TTFT observation: its trace id (Grafana's exemplarTraceIdDestinations)
EXEMPLAR_TRACE_ID = "trace_id"
ROUTER_ITL_SECONDS = "disagg_router_itl_seconds"                    # histogram
ROUTER_E2E_SECONDS = "disagg_router_request_duration_seconds"       # histogram
ROUTER_INPUT_TOKENS = "disagg_router_input_tokens"                  # histogram
ROUTER_OUTPUT_TOKENS = "disagg_router_output_tokens"                # histogram
ROUTER_REQUESTS = "disagg_router_requests_total"                    # counter; labels: outcome, path
ROUTER_FALLBACKS = "disagg_router_fallbacks_total"                  # counter; labels: reason
ROUTER_ROUTING_DECISIONS = "disagg_router_routing_decisions_total"  # counter; labels: policy, role, worker
ROUTER_LOAD_BOUNDED = "disagg_router_load_bounded_decisions_total"  # counter; labels: role (the skew bound overrode cache affinity)
ROUTER_PROMPT_TOKENS = "disagg_router_prompt_tokens_total"          # counter
ROUTER_CACHED_PROMPT_TOKENS = "disagg_router_cached_prompt_tokens_total"  # counter (prefix hit ratio = cached/prompt)
ROUTER_ACTIVE_REQUESTS = "disagg_router_active_requests"            # gauge; labels: role, worker
ROUTER_WORKERS = "disagg_router_workers"                            # gauge; labels: role, state
ROUTER_ROUTING_SECONDS = "disagg_router_routing_decision_seconds"   # histogram; labels: policy, role
ROUTER_INDEXED_BLOCKS = "disagg_router_indexed_blocks"              # gauge; labels: role
ROUTER_KV_EVENT_BATCHES = "disagg_router_kv_event_batches_total"    # counter
ROUTER_KV_INDEX_RESYNCS = "disagg_router_kv_index_resyncs_total"    # counter; labels: reason, outcome
ROUTER_KV_EVENT_BATCHES_MISSED = "disagg_router_kv_event_batches_missed_total"  # counter: not received live (replayed or not)
ROUTER_IN_FLIGHT = "disagg_router_in_flight_requests"              # gauge: admitted, not yet answered in full
ROUTER_QUEUE_DEPTH = "disagg_router_queued_requests"                # gauge: waiting for admission
ROUTER_QUEUE_WAIT_SECONDS = "disagg_router_queue_wait_seconds"      # histogram: admission wait of admitted requests (0: at once)
ROUTER_REJECTED = "disagg_router_rejected_requests_total"           # counter; labels: reason (429s)
ROUTER_TIMEOUTS = "disagg_router_upstream_timeouts_total"           # counter; labels: kind (worker calls cut)
ROUTER_MIGRATIONS = "disagg_router_migrations_total"                # counter; labels: outcome (failed decode streams continued elsewhere, or why not)
ROUTER_AUTH_FAILURES = "disagg_router_auth_failures_total"          # counter; labels: reason (401s: never in ROUTER_REQUESTS, whose rate the planner reads as load)
ROUTER_API_KEYS = "disagg_router_api_keys"                          # gauge: API keys loaded (spec.router.auth)
ROUTER_PAIRING_REFUSALS = "disagg_router_pairing_refusals_total"  # counter; labels: reason (a request not paired with a prefill of another KV revision)
# flex workers (spec.flex): each router drains a worker whose serving role changed before it sends it the new role's work
ROUTER_FLEX_WORKERS = "disagg_router_flex_workers"                  # gauge; labels: role (serving it), state (serving, draining: taking no new work until its drain ends)
ROUTER_ROLE_SWITCHES = "disagg_router_role_switches_total"          # counter; labels: from_role, to_role, outcome (switched, abandoned: the drain's bound passed, cancelled: asked back before it ended)
ROUTER_SWITCH_DRAIN_SECONDS = "disagg_router_switch_drain_seconds"  # histogram; labels: outcome: the serving role changed -> the worker takes the new role's work
ROUTER_KV_HELD = "disagg_router_kv_held_requests"                   # gauge; labels: role, worker: hand-offs whose KV the prefill holds (decode not yet pulled, lease not run out)
# picker mode (spec.router.mode: picker): the gateway carries the bytes, the router answers where they go
ROUTER_PICKER_DECISION_SECONDS = "disagg_router_picker_decision_seconds"  # histogram; labels: kind (plan: an OpenAI request parsed, tokenized and planned, before any prefill; other: any other path)
ROUTER_PICKER_STREAMS = "disagg_router_picker_streams"              # gauge: the gateway's ext_proc streams open now
ROUTER_ADAPTER_WORKERS = "disagg_router_adapter_workers"            # gauge; labels: adapter, role (workers holding a declared LoRA adapter, as the router loaded or saw it)
ROUTER_ADAPTER_LOADS = "disagg_router_adapter_loads_total"           # counter; labels: outcome (load/unload calls to workers: loaded, load_failed, unloaded)
ADAPTER_LOADED, ADAPTER_LOAD_FAILED, ADAPTER_UNLOADED = "loaded", "load_failed", "unloaded"
OUTCOME_UNANSWERED = "unanswered"                 # picker mode: the gateway's stream ended before the decode answered

# request paths (label values of ROUTER_REQUESTS{path=...})
PATH_REMOTE_PREFILL = "remote_prefill"
PATH_LOCAL_PREFILL = "local_prefill"
PATH_FALLBACK = "fallback"
# why a request's decode prefills it itself (the x-disagg-local-reason header of a local_prefill route, and what
# the routing decision says: router/decision.py Plan.reason); REASON_REMOTE when a prefill worker does it
REASON_REMOTE = "remote"
LOCAL_NEVER = "disaggregation_never"              # spec.router.disaggregation: never
LOCAL_NO_PREFILL = "no_prefill"                   # no healthy prefill of the decode's KV revision
LOCAL_SHORT = "short_uncached"                    # conditional: fewer uncached tokens than the threshold
LOCAL_SATURATED = "prefill_saturated"             # conditional: every prefill at its active limit
# outcomes (ROUTER_REQUESTS{outcome=...}) and fallback reasons (ROUTER_FALLBACKS{reason=...})
OUTCOME_SUCCESS = "success"
OUTCOME_CLIENT_ERROR = "client_error"
OUTCOME_UPSTREAM_ERROR = "upstream_error"
OUTCOME_NO_WORKERS = "no_workers"
OUTCOME_REJECTED = "rejected"                     # admission: 429 (queue full or the wait ran out)
OUTCOME_TIMEOUT = "timeout"                       # a worker call cut by a timeout
OUTCOME_UPSTREAM_REJECTED = "upstream_rejected"   # a worker's 4xx, passed on (e.g. a prompt past its context, untokenized)
OUTCOME_CLIENT_DISCONNECTED = "client_disconnected"  # the client went away mid-stream
# why a request was refused admission (ROUTER_REJECTED{reason=...})
REJECT_QUEUE_FULL = "queue_full"
REJECT_QUEUE_TIMEOUT = "queue_timeout"
# why a request was refused authentication (ROUTER_AUTH_FAILURES{reason=...})
AUTH_MISSING = "missing"                          # no Authorization: Bearer header
AUTH_INVALID = "invalid"                          # a key that is not one of the router's
# why a worker's KV index was resynced (ROUTER_KV_INDEX_RESYNCS{reason=...}) and how it ended ({outcome=...})
RESYNC_GAP = "gap"                                # a batch's sequence number skipped some
RESYNC_RESTART = "restart"                        # the sequence started over, or a replay showed another engine
RESYNC_JOIN = "join"                              # batches published before the router subscribed
RESYNC_REPLAYED = "replayed"                      # the index again reflects every batch the worker published
RESYNC_DROPPED = "dropped"                        # the worker's entries dropped; rebuilt from a suffix and new events
# which timeout cut a worker call (ROUTER_TIMEOUTS{kind=...})
TIMEOUT_CONNECT = "connect"
TIMEOUT_FIRST_TOKEN = "first_token"
TIMEOUT_IDLE = "idle"
TIMEOUT_REQUEST = "request"
FALLBACK_PREFILL_ERROR = "prefill_error"
FALLBACK_PREFILL_TIMEOUT = "prefill_timeout"
FALLBACK_DECODE_RETRY = "decode_retry"
FALLBACK_KV_TRANSFER = "kv_transfer_failed"    # decode could not pull the prefilled KV: it prefills itself
FALLBACK_PREFILL_LOST = "prefill_lost"          # the prefill holding a waiting decode's KV went unhealthy: local prefill
# what became of a decode stream that failed after it began (ROUTER_MIGRATIONS{outcome=...})
MIGRATION_MIGRATED = "migrated"                   # continued on a decode worker from the ids generated so far
MIGRATION_NOT_NEEDED = "not_needed"               # it failed after its last token: the router ended the stream
MIGRATION_EXHAUSTED = "exhausted"                 # spec.router.maxMigrations reached: the client got an error event
MIGRATION_FAILED = "failed"                       # no decode worker could take the continuation: an error event
MIGRATION_UNSUPPORTED = "unsupported"             # logprobs, tools, structured output, or a worker without token ids
MIGRATION_DISABLED = "disabled"                   # maxMigrations 0 (never counted: the label is not used)
# why the router refused to pair a request's decode with a healthy prefill (ROUTER_PAIRING_REFUSALS{reason=...})
PAIRING_OTHER_REVISION = "other_revision"        # healthy prefills, none of the decode's KV revision: decode-only

# what became of a flex worker's role switch (ROUTER_ROLE_SWITCHES{outcome=...}; PLANNER_ROLE_SWITCHES uses the same)
SWITCH_SWITCHED = "switched"
SWITCH_ABANDONED = "abandoned"
SWITCH_CANCELLED = "cancelled"

# ---- vLLM's own metrics, as the router, tests and planner read them from workers' /metrics
VLLM_NIXL_BYTES_TRANSFERRED = "vllm:nixl_bytes_transferred"        # histogram (bytes per transfer)
VLLM_NIXL_FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers"      # counter
VLLM_NIXL_XFER_TIME_SECONDS = "vllm:nixl_xfer_time_seconds"        # histogram (seconds per transfer)
VLLM_PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"            # counter, tokens
VLLM_PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"                  # counter, tokens
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"                          # counter
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"                  # counter
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"            # gauge
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"            # gauge
# gauge; label reason: capacity (waiting for a slot: a batch or KV memory), deferred (blocked meanwhile: a
# remote prefill's KV still loading, a LoRA budget); the two add up to VLLM_NUM_REQUESTS_WAITING
VLLM_NUM_REQUESTS_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
VLLM_WAITING_CAPACITY = "capacity"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"                   # gauge, 0..1
VLLM_TTFT_SECONDS = "vllm:time_to_first_token_seconds"             # histogram (arrival at the engine to its first token)
VLLM_ITL_SECONDS = "vllm:inter_token_latency_seconds"              # histogram (per gap)
# gauge (LoRA on): one sample per label set ever reported, each set to the time it was last reported (the freshest is
# now); labels max_lora, running_lora_adapters and waiting_lora_adapters (comma-separated adapter names)
VLLM_LORA_REQUESTS_INFO = "vllm:lora_requests_info"

# ---- planner (labels: deployment, namespace)
PLANNER_DECISIONS = "disagg_planner_decisions_total"                # counter; labels: role, direction, reason
PLANNER_DESIRED_REPLICAS = "disagg_planner_desired_replicas"        # gauge; labels: role
PLANNER_PREDICTED_REQUEST_RATE = "disagg_planner_predicted_request_rate"  # gauge, requests/s
PLANNER_OBSERVED_TTFT_SECONDS = "disagg_planner_observed_ttft_seconds"    # gauge
PLANNER_OBSERVED_ITL_SECONDS = "disagg_planner_observed_itl_seconds"      # gauge
PLANNER_METRICS_AVAILABLE = "disagg_planner_metrics_available"      # gauge 0/1
PLANNER_MODEL_KNOWN = "disagg_planner_model_known"                  # gauge 0/1: the model and GPU are in the performance model's data (0: it holds)
PLANNER_ERRORS = "disagg_planner_errors_total"                      # counter; labels: stage, error (a failed call costs one pass, never the process; no deployment labels)
PLANNER_LAST_PASS = "disagg_planner_last_pass_timestamp_seconds"    # gauge, unix seconds: the loop's last progress (no deployment labels; /healthz reads the same heartbeat)
# flex workers (issue 31; named here for the design in planner/README.md "Flex workers": the simulator reports the
# same quantities, the executor does not expose them yet). PLANNER_DECISIONS and PLANNER_DESIRED_REPLICAS carry
# role="flex" for the pool; a switch counts role=<to> direction=up and role=<from> direction=down, reason RoleSwitched
PLANNER_FLEX_WORKERS = "disagg_planner_flex_workers"                # gauge; labels: role (serving it or switching to it)
PLANNER_ROLE_SWITCHES = "disagg_planner_role_switches_total"        # counter; labels: from_role, to_role, outcome (switched, cancelled, abandoned)
PLANNER_SWITCH_DRAIN_SECONDS = "disagg_planner_switch_drain_seconds"  # histogram: a switch asked -> the worker serving its new role

# ---- operator
OPERATOR_RECONCILES = "disagg_operator_reconciles_total"            # counter; labels: result (applied, unchanged, conflict, error, invalid, blocked, unsupported)
OPERATOR_GANG_WAIT_SECONDS = "disagg_operator_gang_wait_seconds"    # histogram: first gang pod created -> gang placed
OPERATOR_CHILD_WRITES = "disagg_operator_child_writes_total"        # counter; labels: kind
OPERATOR_DRIFT_REVERTS = "disagg_operator_drift_reverts_total"      # counter; labels: kind, manager (who changed it)
# counter; labels: namespace, deployment, role. A multi-pod replica recreated as a whole (operator/groups.py)
OPERATOR_GROUP_RESTARTS = "disagg_operator_group_restarts_total"
OPERATOR_STATUS_WRITES = "disagg_operator_status_writes_total"      # counter
OPERATOR_DEPLOYMENTS = "disagg_operator_deployments"                # gauge; labels: phase
# flex workers (spec.flex): per deployment, by the serving-role label the operator reads on their pods
OPERATOR_FLEX_WORKERS = "disagg_operator_flex_workers"              # gauge; labels: namespace, deployment, role
OPERATOR_ROLE_SWITCHES = "disagg_operator_role_switches_total"      # counter; labels: namespace, deployment, from_role, to_role (a flex pod's serving-role label changed)
OPERATOR_CONDITION = "disagg_operator_condition"                    # gauge 0/1; labels: namespace, deployment, type, reason
