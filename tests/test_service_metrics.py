"""The ingress's latency metrics: the client's way in from X-Request-Start, and the reply's time-to-X histograms."""

from __future__ import annotations

import pytest

from omni_ray.serve.metrics import ServiceMetrics, parse_request_start


def _sample(metrics: ServiceMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


@pytest.mark.parametrize("header", ["t=1764500000123456", "1764500000123456", "t=1764500000123", "1764500000.123456"])
def test_request_start_in_any_unit_reads_as_epoch_seconds(header: str) -> None:
    assert parse_request_start(header) == pytest.approx(1764500000.123, abs=1e-3)


@pytest.mark.parametrize("header", [None, "", "t=", "yesterday", "t=12ab"])
def test_unreadable_request_start_is_ignored(header: str | None) -> None:
    assert parse_request_start(header) is None


def test_request_path_observes_only_plausible_headers() -> None:
    metrics = ServiceMetrics()
    metrics.observe_request_path("t=1764500000000000", 1764500000.25)  # 250 ms on the way in
    metrics.observe_request_path(None, 1764500000.25)  # no header
    metrics.observe_request_path("t=1764500001000000", 1764500000.25)  # a clock ahead of ours: not a duration
    metrics.observe_request_path("garbage", 1764500000.25)
    assert _sample(metrics, "omni_request_path_seconds_count") == 1
    assert _sample(metrics, "omni_request_path_seconds_sum") == pytest.approx(0.25)


def test_reply_timing_fills_each_time_to_x_histogram_from_submission() -> None:
    metrics = ServiceMetrics()
    timing = {"submitted": 100.0, "streams_open": 100.05, "prefill_launched": 100.06, "first_token": 100.1,
              "first_text_queued": 100.102, "first_text_sent": 100.104, "first_text_arrived": 100.11,
              "talker_first_text": 100.12, "first_frame_launched": 100.15, "first_frame": 100.2, "first_audio": 100.3,
              "first_audio_received": 100.31, "first_audio_sent": 100.32, "last_token": 100.5,
              "talker_text_end": 100.51, "text_read": 100.52, "last_frame": 100.8, "last_audio": 100.9}
    metrics.observe_reply(timing, audio_seconds=2.0, finished_at=101.0)
    for name, seconds in (("omni_time_to_streams_open_seconds", 0.05), ("omni_time_to_prefill_launch_seconds", 0.06),
                          ("omni_time_to_first_token_seconds", 0.1), ("omni_time_to_first_text_queued_seconds", 0.102),
                          ("omni_time_to_first_text_sent_seconds", 0.104),
                          ("omni_time_to_first_text_arrived_seconds", 0.11),
                          ("omni_time_to_talker_first_text_seconds", 0.12),
                          ("omni_time_to_first_frame_launch_seconds", 0.15), ("omni_time_to_first_frame_seconds", 0.2),
                          ("omni_time_to_first_audio_seconds", 0.3),
                          ("omni_time_to_first_audio_received_seconds", 0.31),
                          ("omni_time_to_first_audio_sent_seconds", 0.32),
                          ("omni_time_to_last_token_seconds", 0.5), ("omni_time_to_talker_text_end_seconds", 0.51),
                          ("omni_time_to_text_read_seconds", 0.52), ("omni_time_to_last_frame_seconds", 0.8),
                          ("omni_time_to_last_audio_seconds", 0.9), ("omni_real_time_factor", 0.5)):
        assert _sample(metrics, f"{name}_sum") == pytest.approx(seconds), name


def _page(text: bytes) -> dict[str, float]:
    """A /metrics page's samples by `name{labels}`."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_the_page_sums_every_ingress_replicas_requests_and_keeps_stage_gauges_once() -> None:
    mine, peer = ServiceMetrics(), ServiceMetrics()
    mine.observe_reply({"submitted": 0.0, "first_audio": 0.2}, audio_seconds=1.0, finished_at=1.0)
    peer.observe_reply({"submitted": 0.0, "first_audio": 0.3}, audio_seconds=1.0, finished_at=1.0)
    peer.observe_reply({"submitted": 0.0, "first_audio": 0.04}, audio_seconds=1.0, finished_at=1.0)
    mine.requests.labels("chat", "200").inc()
    peer.requests.labels("chat", "200").inc(2)
    peer.requests.labels("speech", "400").inc()  # a series only the peer has
    stages = {"r1": {"stage": "talker", "running": 3}}

    page = _page(mine.render(stages, [peer.reply_samples()]))

    assert page["omni_time_to_first_audio_seconds_count[]"] == 3
    assert page["omni_time_to_first_audio_seconds_sum[]"] == pytest.approx(0.54)
    assert page["omni_time_to_first_audio_seconds_bucket[('le', '0.05')]"] == 1  # the peer's 40 ms reply
    assert page["omni_time_to_first_audio_seconds_bucket[('le', '0.25')]"] == 2
    assert page["omni_requests_total[('endpoint', 'chat'), ('status', '200')]"] == 3
    assert page["omni_requests_total[('endpoint', 'speech'), ('status', '400')]"] == 1
    assert page["omni_stage_running[('replica', 'r1'), ('stage', 'talker')]"] == 3  # from the board, not summed
    assert page["omni_stage_replicas[('stage', 'talker')]"] == 1
    assert not any("_created" in key for key in page)  # per-replica timestamps do not add up
    alone = _page(mine.render(stages))
    assert alone["omni_time_to_first_audio_seconds_count[]"] == 1


def test_what_a_replica_posts_leaves_out_the_stage_gauges() -> None:
    metrics = ServiceMetrics()
    metrics.render({"r1": {"stage": "talker", "running": 3}})
    posted = metrics.reply_samples()
    assert "omni_time_to_first_audio_seconds" in posted and "omni_requests_in_flight" in posted
    assert not any(name.startswith("omni_stage_") for name in posted)
