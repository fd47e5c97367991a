"""The normalised value function's statistics (policies/base.py ValueNormalizer), as VPT's and
MineStudio's NormalizeEwma keeps them: debiased EWMA moments of the value targets, starting from zero.

A second moment that started at 1 made the variance after the first update about 1e5 (std ~316): the
value head learned targets divided by hundreds and its loss was ~1e-5 for a whole Crafter run."""

from __future__ import annotations

import pytest
import torch

from overworld.policies.base import ValueNormalizer


def test_after_one_batch_the_targets_are_normalised_by_that_batchs_mean_and_std() -> None:
    norm = ValueNormalizer(enabled=True)
    targets = torch.tensor([1.0, 3.0, 1.0, 3.0])  # mean 2, std 1
    norm.update(targets.mean(), (targets**2).mean())
    assert norm.normalize(targets).tolist() == pytest.approx([-1.0, 1.0, -1.0, 1.0], abs=1e-4)
    assert norm.denormalize(torch.tensor([1.0])).item() == pytest.approx(3.0, abs=1e-4)


def test_the_statistics_follow_every_batch_with_equal_weight_early_on() -> None:
    norm = ValueNormalizer(enabled=True)
    first, second = torch.tensor([0.0, 2.0]), torch.tensor([10.0, 12.0])
    for batch in (first, second):
        norm.update(batch.mean(), (batch**2).mean())
    both = torch.cat([first, second])  # beta 0.99999: two batches weigh the same
    expected = (torch.tensor([11.0]) - both.mean()) / both.std(unbiased=False)
    assert norm.normalize(torch.tensor([11.0])).item() == pytest.approx(expected.item(), rel=1e-3)


def test_constant_targets_are_not_blown_up() -> None:
    """Sparse rewards give batches of identical targets: the std has MineStudio's floor of 0.1."""
    norm = ValueNormalizer(enabled=True)
    norm.update(torch.tensor(0.0), torch.tensor(0.0))
    assert norm.normalize(torch.tensor([1.0])).item() == pytest.approx(10.0, rel=1e-4)


def test_disabled_or_before_any_batch_it_is_the_identity() -> None:
    x = torch.tensor([5.0, -3.0])
    assert torch.equal(ValueNormalizer(enabled=True).normalize(x), x)
    off = ValueNormalizer(enabled=False)
    off.update(torch.tensor(2.0), torch.tensor(5.0))
    assert torch.equal(off.normalize(x), x) and torch.equal(off.denormalize(x), x)
