"""The Crafter cow task: what it summons and gives, how it rewards, when it ends."""

from __future__ import annotations

import numpy as np
from crafter import objects

from overworld.envs.crafter_cow import make_env
from overworld.envs.crafter_cow_scripted import ScriptedCowHunter

TASK = {"size": 64, "area": 32, "timestep_limit": 1000, "num_cows": 10, "spawn_range": 5, "max_reward_times": 30}


def cows_near(env, distance: int) -> int:  # type: ignore[no-untyped-def]
    player = env._env._player
    return sum(isinstance(o, objects.Cow) and np.abs(o.pos - player.pos).max() <= distance
               for o in env._env._world.objects)


def play(env, hunter: ScriptedCowHunter, limit: int = 2000) -> tuple[float, int, dict, bool, bool]:  # type: ignore[no-untyped-def]
    total, steps = 0.0, 0
    while steps < limit:
        _, reward, terminated, truncated, info = env.step(hunter.act(env))
        assert reward in (0.0, 1.0)
        total += reward
        steps += 1
        if terminated or truncated:
            return total, steps, info, terminated, truncated
    raise AssertionError(f"no episode end in {limit} steps")


def test_reset_summons_cows_near_the_player_and_gives_the_sword() -> None:
    env = make_env(**TASK)
    plain = make_env(**{**TASK, "num_cows": 0, "sword": None})
    obs, _ = env.reset(seed=3)
    plain.reset(seed=3)  # the same world, nothing added
    assert obs.shape == (64, 64, 3) and obs.dtype == np.uint8
    assert cows_near(env, 5) >= cows_near(plain, 5) + 10
    assert env._env._player.inventory["iron_sword"] == 1
    assert plain._env._player.inventory["iron_sword"] == 0


def test_reward_is_one_per_cow_eaten_up_to_max_reward_times() -> None:
    env = make_env(**TASK)
    env.reset(seed=0)
    total, _, info, _, _ = play(env, ScriptedCowHunter(0))
    assert total == info["cows_eaten"] >= 5  # summoned cows next to a player with a sword

    capped = make_env(**{**TASK, "max_reward_times": 2})
    capped.reset(seed=0)
    total, _, info, _, _ = play(capped, ScriptedCowHunter(0))
    assert info["cows_eaten"] > 2 and total == 2.0


def test_the_time_limit_truncates_and_death_terminates() -> None:
    env = make_env(**{**TASK, "timestep_limit": 5})
    env.reset(seed=1)
    ends = [env.step(0)[2:4] for _ in range(5)]
    assert ends[:4] == [(False, False)] * 4 and ends[4] == (False, True)

    env = make_env(**TASK)
    env.reset(seed=1)
    env._env._player.health = 0
    _, _, terminated, truncated, _ = env.step(0)
    assert terminated and not truncated
