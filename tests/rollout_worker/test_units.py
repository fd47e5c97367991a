"""Small pieces of the worker: the sampler, the fragment cutter, the episode outbox."""

from __future__ import annotations

import numpy as np
import torch

from overworld.core.specs import Spaces, TensorSpec
from overworld.policies.base import log_prob
from overworld.rollout_worker.episodes import OUTBOX_LIMIT, EpisodeTracker
from overworld.rollout_worker.fragments import FragmentCutter
from overworld.rollout_worker.worker import sample_with_log_prob


def test_sampler_matches_categorical() -> None:
    torch.manual_seed(0)
    logits = {"a": torch.randn(4000, 1, 5) * 2, "b": torch.randn(4000, 1, 3)}
    actions, logp = sample_with_log_prob(logits)
    expected = log_prob({k: v[:, 0] for k, v in logits.items()}, actions)
    torch.testing.assert_close(logp, expected)
    probs = torch.softmax(logits["a"][0, 0], -1)
    same = {"a": logits["a"][:1].expand(4000, 1, 5)}
    counts = torch.bincount(sample_with_log_prob(same)[0]["a"], minlength=5).float() / 4000
    torch.testing.assert_close(counts, probs, atol=0.03, rtol=0)


def test_cutter_slots_advance_independently_and_drops_leave_a_sequence_gap() -> None:
    spaces = Spaces(obs={"obs": TensorSpec((2,), "float32")}, action={"action": TensorSpec((), "int64")},
                    state={"h": TensorSpec((3,), "float32")})
    cut = FragmentCutter(spaces, 3, 4)
    state = {"h": np.arange(9, dtype=np.float32).reshape(3, 3)}

    def step(slots: list[int], t: int) -> np.ndarray:
        idx = np.array(slots)
        cut.record_action(idx, {"obs": np.full((len(idx), 2), t, np.float32)}, {"action": idx},
                          np.zeros(len(idx), bool), np.zeros(len(idx), np.float32), np.zeros(len(idx), np.float32),
                          7, {k: v[idx] for k, v in state.items()})
        return cut.record_outcome(idx, np.ones(len(idx), np.float32), np.zeros(len(idx), bool),
                                  np.zeros(len(idx), bool), np.zeros(len(idx), np.float32))

    for t in range(3):
        assert not step([0, 1, 2], t).size
    assert cut.drop(1) and cut.dropped == 1  # slot 1's env died: 3 steps lost
    assert list(step([0, 2], 3)) == [0, 2]
    seq, data = cut.take(0, {"obs": np.zeros(2, np.float32)})
    assert seq == 0 and data["obs.obs"][:, 0].tolist() == [0, 1, 2, 3] and data["state.h"].tolist() == [0, 1, 2]
    assert data["next_obs.obs"].shape == (1, 2) and (data["model_version"] == 7).all()
    for t in range(4):
        done = step([1], t)
    assert list(done) == [1]
    seq, _ = cut.take(1, {"obs": np.zeros(2, np.float32)})
    assert seq == 1  # 0 was the dropped one: gae and the buffer see a gap
    assert not cut.drop(1)  # nothing partial: no gap


def test_episode_outbox_is_bounded_and_keeps_order() -> None:
    tracker = EpisodeTracker(2, 0.5, "t")
    tracker.stepped(np.array([0, 1]), np.array([1.0, 2.0]))
    tracker.stepped(np.array([0]), np.array([1.0]))
    first = tracker.ended(0, 3, {"x": 1.0})
    assert (first.sum_reward, first.discounted_reward, first.length) == (2.0, 1.5, 2)
    tracker.forget(1)
    taken = tracker.take()
    assert [e.sum_reward for e in taken] == [2.0] and not tracker.take()
    for _ in range(OUTBOX_LIMIT + 5):
        tracker.ended(1, 0, {})
    assert len(tracker.take()) == OUTBOX_LIMIT
