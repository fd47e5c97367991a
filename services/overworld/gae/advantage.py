"""Generalised advantage estimation (and V-trace) over chains of steps, without a per-step loop.

Both are linear recurrences  A_t = x_t + c_t * A_{t+1}  solved by a log-depth parallel scan
(doubling) over the time axis, vectorised over chains.

Truncation bootstraps, termination does not:
  next value of step t = bootstrap_value_t if truncated_t, else V_{t+1} (next_value at the end)
  delta_t = r_t + gamma * (1 - terminated_t) * next_value_t - V_t
  c_t     = gamma * lambda * (1 - done_t),  done = terminated | truncated
"""

from __future__ import annotations

import numpy as np


def _reverse_linear_scan(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Solve A_t = x_t + c_t * A_{t+1} with A_T = 0 along the last axis, in O(log T) numpy passes."""
    a = x.astype(np.float64)
    coef = c.astype(np.float64)
    T = a.shape[-1]
    shift = 1
    while shift < T:
        a[..., :-shift] = a[..., :-shift] + coef[..., :-shift] * a[..., shift:]
        coef[..., :-shift] = coef[..., :-shift] * coef[..., shift:]
        coef[..., -shift:] = 0.0
        shift *= 2
    return a


def _next_values(value: np.ndarray, next_value: np.ndarray, truncated: np.ndarray,
                 bootstrap_value: np.ndarray) -> np.ndarray:
    following = np.concatenate([value[:, 1:], next_value[:, None]], axis=1)
    return np.where(truncated, bootstrap_value, following)


def gae(reward: np.ndarray, value: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
        bootstrap_value: np.ndarray, next_value: np.ndarray, discount: float,
        gae_lambda: float) -> tuple[np.ndarray, np.ndarray]:
    """Returns (advantage, value_target), float32 (B, T)."""
    nv = _next_values(value, next_value, truncated, bootstrap_value)
    delta = reward + discount * (1.0 - terminated) * nv - value
    done = terminated | truncated
    advantage = _reverse_linear_scan(delta, discount * gae_lambda * (1.0 - done))
    return advantage.astype(np.float32), (advantage + value).astype(np.float32)


def vtrace(reward: np.ndarray, value: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
           bootstrap_value: np.ndarray, next_value: np.ndarray, behaviour_logp: np.ndarray,
           target_logp: np.ndarray, discount: float, gae_lambda: float = 1.0, rho_clip: float = 1.0,
           c_clip: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """V-trace (Espeholt et al. 2018, eq. 1 and remark 4.2) for stale fragments.

      rho_t = min(rho_clip, pi/mu),  c_t = lambda * min(c_clip, pi/mu)
      v_t - V_t = rho_t * delta_t + gamma * c_t * (v_{t+1} - V_{t+1})
      advantage_t = r_t + gamma * v_{t+1} - V_t

    The advantage is the paper's policy-gradient one *without* its rho_t factor: PPO's ratio pi/mu
    is that importance weight already (and PPO clips it); multiplying by rho_t as well would weight
    every step twice. Returns (advantage, value target v_t).
    """
    ratio = np.exp(np.clip(target_logp - behaviour_logp, -20.0, 20.0))
    rho = np.minimum(rho_clip, ratio)
    cs = gae_lambda * np.minimum(c_clip, ratio)
    nv = _next_values(value, next_value, truncated, bootstrap_value)
    delta = rho * (reward + discount * (1.0 - terminated) * nv - value)
    done = terminated | truncated
    vs_minus_v = _reverse_linear_scan(delta, discount * cs * (1.0 - done))
    vs = vs_minus_v + value
    # v_{t+1}: the next step's V-trace target; at a truncation the final observation's value (no
    # V-trace correction exists beyond the episode's end), after the chain's last step V(next_obs).
    vs_next = _next_values(vs, next_value, truncated, bootstrap_value)
    advantage = reward + discount * (1.0 - terminated) * vs_next - value
    return advantage.astype(np.float32), vs.astype(np.float32)
