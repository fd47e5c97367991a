"""A scripted player for the Crafter cow task that reads the game's state: the upper reference of
the learning benchmark (the issue quotes "about 9 cows per episode" for such a player).

It fights a zombie that comes within 2 cells, drinks when thirsty (Crafter's player dies of thirst
after ~180 steps otherwise), and otherwise walks to the nearest cow and hits it until it is eaten.
Greedy moves along the longer axis, the other axis when blocked, a few random moves when stuck.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from crafter import objects

MOVES: dict[tuple[int, ...], int] = {(-1, 0): 1, (1, 0): 2, (0, -1): 3, (0, 1): 4}  # move_left, move_right, move_up, move_down
DO = 5
THIRSTY_BELOW = 5


class ScriptedCowHunter:
    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.last_pos: tuple[int, int] | None = None
        self.last_move: tuple[int, int] | None = None
        self.wander = 0  # random moves left after getting stuck

    def _nearest(self, world: Any, pos: np.ndarray, kind: type[Any], within: int = 10**6) -> np.ndarray | None:
        found = [obj.pos for obj in world.objects if isinstance(obj, kind) and np.abs(obj.pos - pos).sum() <= within]
        if not found:
            return None
        return min(found, key=lambda p: int(np.abs(p - pos).sum()))

    def _nearest_water(self, world: Any, pos: np.ndarray) -> np.ndarray | None:
        water = np.argwhere(world._mat_map == world._mat_ids["water"])
        if not len(water):
            return None
        return water[np.abs(water - pos).sum(1).argmin()]

    def act(self, env: Any) -> int:
        """The action for the CrafterCow `env` (an overworld.envs.crafter_cow.CrafterCow) now."""
        world, player = env._env._world, env._env._player
        pos = np.asarray(player.pos)
        target = self._nearest(world, pos, objects.Zombie, within=2)
        if target is None and player.inventory["drink"] < THIRSTY_BELOW:
            target = self._nearest_water(world, pos)
        if target is None:
            target = self._nearest(world, pos, objects.Cow)
        if target is None or self.wander > 0:
            self.wander = max(0, self.wander - 1)
            self.last_pos = None
            return int(self.rng.integers(1, 5))
        offset = tuple(int(v) for v in np.asarray(target) - pos)
        if abs(offset[0]) + abs(offset[1]) == 1:
            # adjacent: face it (a move into an occupied cell only turns the player), then hit / drink
            self.last_pos = None
            return DO if tuple(int(v) for v in player.facing) == offset else MOVES[offset]
        blocked = self.last_pos == tuple(pos) and self.last_move is not None
        steps = [(int(np.sign(offset[0])), 0), (0, int(np.sign(offset[1])))]
        steps = [s for s in steps if s != (0, 0)]
        steps.sort(key=lambda s: -abs(offset[0] if s[1] == 0 else offset[1]))
        if blocked:
            steps = [s for s in steps if s != self.last_move]
            if not steps:
                self.wander = 3
                return int(self.rng.integers(1, 5))
        move = steps[0]
        self.last_pos, self.last_move = tuple(pos), move
        return MOVES[move]
