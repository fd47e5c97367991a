"""Where a run's env steps went: trained on, or not, and why (the summary's `env_steps_not_trained`).

Counted in env steps from the final counts of the fleet (read after the workers stopped and reported),
the trainer and the replay buffer:

- `stale_on_arrival`: chunks already older than max_staleness when they reached the buffer (stepped too
  slowly for the learner's pace, or held in a worker's send queue); `stale`: chunks that went stale
  waiting in the buffer; `evicted`: pushed out by `max_chunks`; `incomplete`: partial chunks broken by a
  gap in a slot's sequence (one fragment's worth each, at least);
- `rejected`: fragments the buffer refused as invalid;
- `left_in_buffer`: held when the run ended, never sampled;
- `claimed_not_trained`: sampled for an iteration that the end of the run cut short (prefetched batches);
- `not_sent`: stepped but never handed to the buffer: fragments under way when the run ended, and partial
  fragments of env processes that failed (what the workers held when they stopped).

The parts are estimates where a count is of chunks (a chunk of `fragments_per_chunk` fragments); their
sum and `trained` make `stepped` up to the steps of chunks sampled more than once (max_reuse > 1).
"""

from __future__ import annotations

from typing import Any

from overworld.core.config import RunConfig
from overworld.v1 import replay_buffer_pb2


def not_trained(config: RunConfig, stepped: int, trained: int,
                buffer: replay_buffer_pb2.BufferStats | None) -> dict[str, int]:
    """The env steps of a run that were not trained on, by reason (see the module's docstring)."""
    if buffer is None:
        return {"not_sent_or_unknown": max(0, stepped - trained)}
    steps = config.rollout_config.fragment_length
    chunk_steps = steps * config.rollout_config.replay_buffer_config.fragments_per_chunk
    drops = dict(buffer.dropped_chunks)
    rejected = sum(buffer.rejected_fragments.values())
    out = {
        "stale_on_arrival": drops.get("stale_on_arrival", 0) * chunk_steps,
        "stale": drops.get("stale", 0) * chunk_steps,
        "evicted": drops.get("evicted", 0) * chunk_steps,
        "incomplete": drops.get("incomplete", 0) * steps,
        "rejected": rejected * steps,
        "left_in_buffer": buffer.fragments * steps,
        "claimed_not_trained": max(0, buffer.sampled_chunks * chunk_steps - trained),
        "not_sent": max(0, stepped - (buffer.inserted_fragments + rejected) * steps),
    }
    return {reason: n for reason, n in out.items() if n}


def idle_share(room_wait_seconds: float, env_slot_seconds: float) -> float | None:
    """The share of env-slot time spent waiting for room in the replay buffer."""
    return round(room_wait_seconds / env_slot_seconds, 4) if env_slot_seconds > 0 else None


def policy_lag(metrics: Any) -> dict[str, float | None]:
    """Median and 95th percentile of the policy lag of every step trained on (the learner's figures)."""
    return {"p50": metrics.get("trainer/policy_lag_p50"), "p95": metrics.get("trainer/policy_lag_p95")}
