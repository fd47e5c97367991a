"""Overworld's value normaliser against MineStudio's own (VPT's NormalizeEwma, the value head's
`normalizer` that MineStudio's PPO trains with use_normalized_vf): the same batches of value targets
give the same normalised and denormalised values. Needs minestudio (make test-minestudio)."""

from __future__ import annotations

import pytest

pytest.importorskip("minestudio", reason="`make test-minestudio` installs minestudio in .venv-minestudio")

import torch  # noqa: E402
from minestudio.utils.vpt_lib.normalize_ewma import NormalizeEwma  # noqa: E402

from overworld.policies.base import ValueNormalizer  # noqa: E402

pytestmark = pytest.mark.minestudio


def test_the_same_targets_normalise_as_minestudios_normalize_ewma() -> None:
    generator = torch.Generator().manual_seed(0)
    theirs = NormalizeEwma(1, norm_axes=1)
    ours = ValueNormalizer(enabled=True)
    # Sparse early returns (all zero), then growing ones, as a Crafter run sees them.
    batches = [torch.zeros(256), *(torch.randn(256, generator=generator) * scale + shift
                                   for scale, shift in ((0.3, 0.1), (1.0, 0.5), (2.0, 1.5), (4.0, 3.0)))]
    probe = torch.linspace(-5, 5, 11)
    for batch in batches:
        theirs.train()
        theirs(batch.unsqueeze(1))  # the forward pass in training mode updates the statistics
        ours.update(batch.mean(), (batch**2).mean())
        theirs.eval()
        expected = theirs(probe.unsqueeze(1)).squeeze(1)
        assert ours.normalize(probe).tolist() == pytest.approx(expected.tolist(), rel=1e-4, abs=1e-5)
        restored = theirs.denormalize(probe.unsqueeze(1)).squeeze(1)
        assert ours.denormalize(probe).tolist() == pytest.approx(restored.tolist(), rel=1e-4, abs=1e-5)
