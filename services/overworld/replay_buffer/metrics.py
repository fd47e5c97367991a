"""The front's Prometheus metrics (docs/replay_buffer.md, Metrics): gauges describe the whole buffer,
counters what this front did."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

FRAGMENTS = Gauge("overworld_replay_buffer_fragments", "Fragments held")
BYTES = Gauge("overworld_replay_buffer_bytes", "Bytes held")
CAPACITY = Gauge("overworld_replay_buffer_capacity_fragments", "Capacity in fragments")
INSERTS = Counter("overworld_replay_buffer_inserts_total", "Fragments accepted")
SAMPLES = Counter("overworld_replay_buffer_samples_total", "Fragments sampled")
DROPS = Counter("overworld_replay_buffer_drops_total", "Chunks removed, by reason", ["reason"])
REJECTS = Counter("overworld_replay_buffer_rejects_total", "Invalid fragments refused", ["reason"])
SAMPLE_WAIT = Histogram("overworld_replay_buffer_sample_wait_seconds", "Time a Sample call waited for data",
                        buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0))
INGEST_LATENCY = Histogram("overworld_replay_buffer_ingest_latency_seconds",
                           "Receipt to acknowledgement per fragment (validate + blob write + index add)",
                           buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5))
STALENESS = Gauge("overworld_replay_buffer_staleness", "Model versions behind, over held chunks", ["stat"])
SAMPLE_LAG = Histogram("overworld_replay_buffer_sample_policy_lag",
                       "Policy lag of sampled chunks: model versions between the learner's and the one that acted "
                       "(at the chunk's first step)", buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
MEAN_REUSE = Gauge("overworld_replay_buffer_mean_reuse", "Mean times sampled of removed chunks")
DUPLICATES = Counter("overworld_replay_buffer_duplicates_total",
                     "Fragments at or below their slot's last sequence number (resends), acknowledged, not re-added")
RESERVED = Counter("overworld_replay_buffer_reserved_total",
                   "Fragments' room reserved by workers before stepping them (Reserve)")
RESERVED_NOW = Gauge("overworld_replay_buffer_reserved_fragments",
                     "Fragments' room reserved and not yet taken by a fragment (all fronts)")
ORPHANS = Counter("overworld_replay_buffer_orphans_swept_total", "Unreferenced blobs deleted by the sweeper")
REF_SAMPLES = Counter("overworld_replay_buffer_ref_samples_total",
                      "Fragments sampled as blob keys (blob_refs: the reader fetched them from the store)")


def rejects_by_reason() -> dict[str, int]:
    out = {}
    for metric in REJECTS.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["reason"]] = int(sample.value)
    return out
