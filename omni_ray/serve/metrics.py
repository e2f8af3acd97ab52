"""Prometheus metrics of the HTTP service: requests by status, latency to first token/audio, RTF, stage load."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

# One ingress replica's request-level samples, as it posts them for the others: {family: [(sample, labels, value)]}
ReplySamples = dict[str, list[tuple[str, dict[str, str], float]]]

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
STAGE_GAUGES = {
    "running": "sequences in the engine's running batch",
    "waiting": "sequences waiting for admission (queue depth)",
    "expected_wait_s": "how long a request added now would wait for admission: the waiting requests' token or frame "
                       "budgets over the engine's full-batch rate (s)",
    "refused": "requests the stage refused because their expected wait was over max_queue_wait_s (cumulative)",
    "streams": "requests with an open stream on the replica",
    "kv_used": "KV cache slots in use",
    "step_ms_p50": "median engine step time over the last 256 steps (ms)",
    "step_ms_mean": "mean engine step time over the last 256 steps (ms)",
    "step_ms_p90": "90th percentile of the engine's step time over the last 256 steps (ms)",
    "batch_mean": "mean sequences per engine step over the last 256 steps",
    "launch_ms_p50": "median host time queueing a step's device work, over the last 256 steps (ms)",
    "outputs_ms_p50": "median host time handing a step's outputs on (stream events, relay), over the last 256 steps (ms)",
    "launch_ms_mean": "mean host time queueing a step's device work, over the last 256 steps (ms)",
    "outputs_ms_mean": "mean host time handing a step's outputs on, over the last 256 steps (ms)",
    "collect_ms_p50": "median time in the runner's collect, over the last 256 steps (ms): the wait for the device, "
                      "then reading the step's results back (a loop that does not launch ahead counts it in launch_ms "
                      "too)",
    "collect_ms_mean": "mean time in the runner's collect, over the last 256 steps (ms)",
    "launch_cpu_ms_p50": "median CPU time of the engine thread while queueing a step, over the last 256 steps (ms); "
                         "the rest of launch_ms it waited (for the GIL, or inside CUDA calls)",
    "outputs_cpu_ms_p50": "median CPU time of the engine thread while handing a step's outputs on, over the last 256 "
                          "steps (ms); the rest of outputs_ms it waited (for the GIL, or for the relay's host copy)",
    "prefill_batches": "prefill batches the engine has run (cumulative)",
    "prefilled_sequences": "sequences those prefill batches held (cumulative; over an interval, per batch: how many "
                           "requests a burst's prefills took at a time)",
    "startup_process_s": "seconds from the replica's process start to its stage's constructor (imports, the Ray worker)",
    "startup_load_s": "seconds the replica took at startup to load its weights (or make random ones) onto its device",
    "startup_warmup_s": "seconds the replica took at startup to compile and capture its CUDA graphs",
    "startup_compile_s": "seconds of the replica's startup (its load and warm-up) spent in torch.compile: dynamo and "
                         "inductor, loads from their caches included",
    "graph_pool_kept_blocks": "blocks of the replica's CUDA graph pools that a capture allocated and something other "
                              "than a graph's outputs still holds: tensors later replays may write over (0 expected)",
    "gc_pause_s": "seconds the replica process's cyclic garbage collector has held the GIL (cumulative): its "
                  "threads, the engine's included, wait that out",
    "gc_collections": "collections of the replica process's garbage collector, every generation (cumulative)",
    "gc_full_collections": "full (generation 2) collections of the replica process, which walk every tracked object "
                           "(cumulative)",
    "gc_full_pause_s": "seconds those full collections took (cumulative)",
    "gc_pause_max_ms": "the replica process's longest garbage-collector pause so far (ms)",
    "gc_frozen_objects": "objects moved out of the collector's way once startup was done (resources."
                         "gc_freeze_after_startup; 0: not asked)",
    "cuda_alloc_retries": "allocations the replica process's CUDA caching allocator retried after freeing its "
                          "cache (cumulative): each synchronises the device inside the call that allocated",
    "cuda_ooms": "CUDA out-of-memory errors in the replica process (cumulative)",
    "decode_busy_s": "seconds the vocoder's decode thread has spent in decode calls (cumulative)",
    "decode_frames": "codec frames the vocoder has decoded, left context included (cumulative)",
    "decode_calls": "batched decode calls the vocoder has made (cumulative)",
    "decode_windows": "streams' chunks the vocoder has decoded, in all its calls (cumulative; per call: the batch)",
    "relay_rejected": "host-path relay connections the replica closed (cumulative): a peer that failed the "
                      "application-secret handshake, or sent a frame that did not decode",
}
# The points of a reply's way that the ingress times from submitting it: {timing key: (histogram name, help)}, in
# the order a reply passes them
TIME_TO = {
    "streams_open": ("streams_open", "time until every stage of the reply had opened its stream"),
    "prefill_launched": ("prefill_launch", "time until the Thinker launched the step that prefills the prompt"),
    "first_token": ("first_token", "time to first text token"),
    "first_text_queued": ("first_text_queued",
                          "time until the Thinker's relay queued the message with the first token for the Talker"),
    "first_text_sent": ("first_text_sent", "time until that message left the Thinker's replica (its tensors placed)"),
    "first_text_arrived": ("first_text_arrived",
                           "time until that message reached the Talker's replica (before its tensors were copied out)"),
    "talker_first_text": ("talker_first_text", "time until the reply's first token reached the Talker"),
    "first_frame_launched": ("first_frame_launch", "time until the Talker launched the step that makes the first frame"),
    "first_frame": ("first_frame", "time to the Talker's first codec frame"),
    "first_audio": ("first_audio", "time to first audio chunk"),
    "first_audio_received": ("first_audio_received",
                             "time until the first audio chunk reached the ingress (vs made by the vocoder)"),
    "first_audio_sent": ("first_audio_sent", "time until the ingress handed the first audio chunk to the HTTP response"),
    "last_token": ("last_token", "time until the Thinker made the reply's last token"),
    "talker_text_end": ("talker_text_end", "time until the end of the Thinker's reply reached the Talker"),
    "text_read": ("text_read", "time until the Talker launched the step that reads past the reply's last token: the end "
                               "of the frames that the Thinker's tokens pace"),
    "last_frame": ("last_frame", "time until the Talker handed on the reply's last codec frame"),
    "last_audio": ("last_audio", "time until the vocoder made the reply's last audio chunk"),
}
# The points of TIME_TO past the first audio: where the rest of a reply's time goes; and the ones up to it
REPLY_END = ("last_token", "talker_text_end", "text_read", "last_frame", "last_audio")
FIRST_AUDIO_WAY = tuple(point for point in TIME_TO if point not in REPLY_END)


def parse_request_start(header: str | None) -> float | None:
    """An `X-Request-Start` header (`t=<epoch>` or a bare epoch, in seconds, milliseconds or microseconds, as load
    balancers and APM agents write it) → epoch seconds; None when absent or unreadable."""
    if not header:
        return None
    try:
        value = float(header.strip().removeprefix("t="))
    except ValueError:
        return None
    if value > 1e14:  # microseconds
        return value / 1e6
    if value > 1e11:  # milliseconds
        return value / 1e3
    return value


class ServiceMetrics:
    """A private registry, rendered by GET /metrics: the request-level counters and histograms summed over every
    ingress replica (each posts its own to the stats board), and every stage replica's load."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("omni_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.cancelled = Counter("omni_requests_cancelled", "requests abandoned by the client", ["endpoint"], registry=r)
        self.stream_failures = Counter("omni_stream_failures", "streamed replies that failed after their headers were "
                                       "sent (a chat stream ends with an error event)", ["endpoint"], registry=r)
        self.in_flight = Gauge("omni_requests_in_flight", "requests being served by the ingress", registry=r)
        # omni_time_to_<name>_seconds: from the ingress submitting the request to a point of the reply's way
        self.time_to = {key: Histogram(f"omni_time_to_{name}_seconds", help_text, buckets=LATENCY_BUCKETS, registry=r)
                        for key, (name, help_text) in TIME_TO.items()}
        self.request_path = Histogram("omni_request_path_seconds",
                                      "from the client's X-Request-Start header to the ingress handler: the HTTP proxy "
                                      "and request routing (requests that send the header)",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.rtf = Histogram("omni_real_time_factor", "wall time / audio seconds of a reply", buckets=RTF_BUCKETS, registry=r)
        self.audio_seconds = Counter("omni_audio_seconds", "seconds of audio produced", registry=r)
        self.stage = {
            name: Gauge(f"omni_stage_{name}", help_text, ["stage", "replica"], registry=r)
            for name, help_text in STAGE_GAUGES.items()
        }
        self.replicas = Gauge("omni_stage_replicas", "replicas reporting, per stage", ["stage"], registry=r)
        self.reply_families = {family.name for family in r.collect()} - {
            family.name for gauge in (*self.stage.values(), self.replicas) for family in gauge.collect()
        }

    def reply_samples(self) -> ReplySamples:
        """This replica's request-level samples (not the stage gauges, which every replica reads from the board),
        without the `_created` timestamps, which do not add up."""
        families = self.registry.collect()
        return {family.name: _summable(family) for family in families if family.name in self.reply_families}

    def observe_reply(self, timing: dict[str, float], audio_seconds: float, finished_at: float) -> None:
        submitted = timing.get("submitted")
        if submitted is None:
            return
        for key, histogram in self.time_to.items():
            if key in timing:
                histogram.observe(timing[key] - submitted)
        if audio_seconds > 0:
            self.audio_seconds.inc(audio_seconds)
            self.rtf.observe((finished_at - submitted) / audio_seconds)

    def observe_request_path(self, request_start: str | None, received: float) -> None:
        """The request's way from the client to the ingress handler, when it says when it left (X-Request-Start)."""
        started = parse_request_start(request_start)
        if started is not None and 0 <= received - started < 3600:  # clocks of one host, or synchronised ones
            self.request_path.observe(received - started)

    def render(self, stage_stats: dict[str, dict[str, Any]], peers: Sequence[ReplySamples] = ()) -> bytes:
        """The /metrics page: stage gauges from `stage_stats` (the board's snapshot) and the request-level samples of
        this replica plus its `peers` (the other ingress replicas' `reply_samples()`)."""
        for gauge in self.stage.values():
            gauge.clear()
        self.replicas.clear()
        counts: dict[str, int] = {}
        for replica, stats in stage_stats.items():
            stage = str(stats.get("stage", "unknown"))
            counts[stage] = counts.get(stage, 0) + 1
            for name, gauge in self.stage.items():
                if name in stats:
                    gauge.labels(stage, replica).set(float(stats[name]))
        for stage, count in counts.items():
            self.replicas.labels(stage).set(count)
        if not peers:
            return generate_latest(self.registry)
        merged = CollectorRegistry(auto_describe=False)
        merged.register(_SummedFamilies(self, peers))  # type: ignore[arg-type]
        return generate_latest(merged)


class _SummedFamilies:
    """A collector yielding `metrics`' families, the request-level ones summed with the peers' samples."""

    def __init__(self, metrics: ServiceMetrics, peers: Sequence[ReplySamples]) -> None:
        self.metrics = metrics
        self.peers = peers

    def collect(self) -> Iterator[Metric]:
        for family in self.metrics.registry.collect():
            if family.name not in self.metrics.reply_families:
                yield family
                continue
            totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for samples in (_summable(family), *(peer.get(family.name, []) for peer in self.peers)):
                for name, labels, value in samples:
                    key = (name, tuple(sorted(labels.items())))
                    totals[key] = totals.get(key, 0.0) + value
            summed = Metric(family.name, family.documentation, family.type, family.unit)
            for (name, labels), value in totals.items():
                summed.add_sample(name, dict(labels), value)
            yield summed


def _summable(family: Metric) -> list[tuple[str, dict[str, str], float]]:
    """A family's samples as (name, labels, value), without the `_created` timestamps, which do not add up."""
    return [(s.name, dict(s.labels), s.value) for s in family.samples if not s.name.endswith("_created")]
