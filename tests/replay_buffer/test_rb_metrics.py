"""Prometheus metrics of the replay buffer, after real traffic, for each backend."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rb_support import insert, sample, stats, wait_until


def _scrape() -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_after_traffic(make_buffer):
    before = _scrape()
    buf = make_buffer(max_chunks=3, max_reuse=2, max_staleness=1, service={"metrics_interval": 0.05})
    insert(buf.client, [buf.fragment(seq=q, version=2) for q in range(5)])  # 2 evicted
    sample(buf.client, 2)
    sample(buf.client, 3)  # at least one chunk sampled twice: reused
    buf.client.set_model_version(3)
    st = stats(buf.client)
    assert st.chunks >= 1

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return _scrape().get(key, 0.0) - before.get(key, 0.0)

    def gauge(name: str, **labels: str) -> float:
        return _scrape()[(name, tuple(sorted(labels.items())))]

    wait_until(lambda: gauge("overworld_replay_buffer_fragments") == st.fragments, 5, "the fragments gauge")
    assert gauge("overworld_replay_buffer_bytes") == st.bytes > 0
    assert gauge("overworld_replay_buffer_capacity_fragments") == 3
    assert delta("overworld_replay_buffer_inserts_total") == 5
    assert delta("overworld_replay_buffer_samples_total") == 5
    assert delta("overworld_replay_buffer_drops_total", reason="evicted") == 2
    assert delta("overworld_replay_buffer_drops_total", reason="reused") == st.dropped_chunks["reused"] >= 1
    assert gauge("overworld_replay_buffer_mean_reuse") == st.mean_reuse > 0
    assert gauge("overworld_replay_buffer_staleness", stat="mean") == st.mean_staleness == 1.0
    assert gauge("overworld_replay_buffer_staleness", stat="max") == st.max_staleness == 1
    assert delta("overworld_replay_buffer_sample_wait_seconds_count") == 2
    assert delta("overworld_replay_buffer_ingest_latency_seconds_count") == 5
    buf.client.set_model_version(4)
    assert delta("overworld_replay_buffer_drops_total", reason="stale") == st.chunks


def test_sampled_chunks_record_their_policy_lag(make_buffer):
    """overworld_replay_buffer_sample_policy_lag: versions between the learner's (SetModelVersion) and
    the one that acted, once per chunk sampled (bench/bench_scale.py reads its median and p95)."""
    buf = make_buffer(max_chunks=8, max_reuse=1, max_staleness=10)
    insert(buf.client, [buf.fragment(seq=q, version=2) for q in range(3)])
    buf.client.set_model_version(5)
    before = _scrape()
    sample(buf.client, 3)
    after = _scrape()

    def bucket(le: str) -> float:
        key = ("overworld_replay_buffer_sample_policy_lag_bucket", (("le", le),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert bucket("2.0") == 0 and bucket("3.0") == 3  # three chunks, each 3 versions behind
    count = ("overworld_replay_buffer_sample_policy_lag_count", ())
    assert after[count] - before.get(count, 0.0) == 3
