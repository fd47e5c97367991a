"""The rollout worker's Prometheus metrics (names as in docs/architecture.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ENV_STEPS = Counter("overworld_env_steps_total", "Environment steps", ["worker"])
FRAGMENTS_SENT = Counter("overworld_fragments_sent_total", "Fragments handed to the sender", ["worker"])
FRAGMENTS_DROPPED = Counter("overworld_fragments_dropped_total",
                            "Partial fragments dropped (env restarted mid-fragment, or no room at shutdown)", ["reason"])
POLICY_LAG = Histogram("overworld_fragment_policy_lag", "Model versions behind at send time",
                       buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32))
INFER_BATCH = Histogram("overworld_inference_batch_size", "Observations per inference call",
                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
INFER_LATENCY = Histogram("overworld_inference_latency_seconds", "Policy forward time",
                          buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25))
STEP_LATENCY = Histogram("overworld_env_step_latency_seconds",
                         "From sending a group's actions to having its step results",
                         buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
ENV_RESTARTS = Counter("overworld_env_restarts_total", "Environment restarts", ["reason"])
SLOTS_WAITING_FOR_ROOM = Gauge("overworld_env_slots_waiting_for_room",
                               "Env slots at a fragment boundary waiting for room in the replay buffer "
                               "(the learner is behind: the fleet steps only what it will sample)")
ROOM_WAIT = Counter("overworld_env_room_wait_seconds_total",
                    "Env-slot seconds spent waiting for room in the replay buffer (each waiting slot counts): "
                    "over num_envs x wall seconds, the share of the fleet idle because the learner is behind",
                    ["worker"])
PREEMPTED_ENV_STEPS = Counter("overworld_worker_preempted_env_steps_total",
                              "Env steps stepped, then thrown away as the worker stopped (partial fragments, "
                              "fragments never acknowledged); the fleet's sum is the rollout-manager's "
                              "overworld_fleet_preempted_env_steps_total")
ENV_SLOTS = Gauge("overworld_env_slots", "Env slots this worker steps (num_envs): the room-wait counter's "
                  "denominator, the autoscaler's idle share", ["worker"])
QUEUE_DEPTH = Gauge("overworld_send_queue_depth", "Fragments waiting to be sent or acknowledged")
MODEL_VERSION = Gauge("overworld_worker_model_version", "Model version in use", ["worker"])
VIDEOS = Counter("overworld_videos_recorded_total", "Episode videos uploaded to the rollout-manager")
