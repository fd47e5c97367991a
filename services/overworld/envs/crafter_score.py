"""The Crafter benchmark's score, as Crafter's own analysis computes it (danijar/crafter,
analysis/common.py): an achievement's success rate is the percentage of the run's training episodes
in which it was unlocked at least once; the score is the geometric mean of the 22 success rates
with an offset of 1%, `exp(mean(ln(1 + s_i))) - 1`; a method's score is the mean over seeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

import numpy as np

ACHIEVEMENTS = (
    "collect_coal", "collect_diamond", "collect_drink", "collect_iron", "collect_sapling", "collect_stone",
    "collect_wood", "defeat_skeleton", "defeat_zombie", "eat_cow", "eat_plant", "make_iron_pickaxe",
    "make_iron_sword", "make_stone_pickaxe", "make_stone_sword", "make_wood_pickaxe", "make_wood_sword",
    "place_furnace", "place_plant", "place_stone", "place_table", "wake_up",
)

# Scores after 1M env steps, from Crafter's README (the goal of issue 18 is above PPO with a ResNet).
PUBLISHED_SCORES = {
    "Random": 1.6, "Stable-Baselines3 PPO": 4.6, "Rainbow": 4.3, "DreamerV2": 10.0, "DreamerV3": 14.5,
    "PPO (ResNet)": 15.6, "Curious Replay": 19.4, "Human experts": 50.5,
}


def success_rates(fractions: Mapping[str, float]) -> dict[str, float]:
    """Per-achievement success rates in percent, from the fraction of episodes that unlocked each one
    (`achievement_<name>` means over all episodes, as the rollout-manager keeps them). An achievement
    that was never reported had a success rate of 0."""
    out = {}
    for name in ACHIEVEMENTS:
        value = float(fractions.get(f"achievement_{name}", 0.0))
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"achievement_{name}: a fraction of episodes must be in [0, 1], got {value}")
        out[name] = 100.0 * value
    return out


def crafter_score(rates_percent: Mapping[str, float]) -> float:
    """The geometric mean of the 22 success rates (percent) with a 1% offset."""
    missing = set(ACHIEVEMENTS) - set(rates_percent)
    if missing:
        raise ValueError(f"success rates missing for {sorted(missing)}")
    rates = np.array([rates_percent[name] for name in ACHIEVEMENTS], dtype=np.float64)
    if ((rates < 0) | (rates > 100)).any():
        raise ValueError("success rates must be percentages in [0, 100]")
    return float(np.exp(np.mean(np.log1p(rates))) - 1.0)


class ScoreSummary(TypedDict):
    score: float
    success_rates: dict[str, float]  # achievement -> percent
    episodes: int


def score_summary(total_extras: Mapping[str, float], episodes: int) -> ScoreSummary | None:
    """The benchmark's view of a task's statistics (the sums of its episodes' `achievement_*` flags
    over all `episodes` of the run), or None for a task that reports no Crafter achievements."""
    if episodes <= 0 or not any(k.startswith("achievement_") for k in total_extras):
        return None
    rates = success_rates({k: v / episodes for k, v in total_extras.items()})
    return {"score": crafter_score(rates), "success_rates": rates, "episodes": episodes}
