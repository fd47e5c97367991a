import numpy as np
import pytest

from overworld.gae.advantage import gae, vtrace


def random_chains(seed: int, B: int = 6, T: int = 53):
    rng = np.random.default_rng(seed)
    terminated = rng.random((B, T)) < 0.08
    truncated = (rng.random((B, T)) < 0.08) & ~terminated
    return dict(
        reward=rng.normal(size=(B, T)).astype(np.float32),
        value=rng.normal(size=(B, T)).astype(np.float32),
        terminated=terminated, truncated=truncated,
        bootstrap_value=(rng.normal(size=(B, T)) * truncated).astype(np.float32),
        next_value=rng.normal(size=B).astype(np.float32),
    )


def reference_gae(c, gamma, lam):
    """A plain per-step loop: what GAE means, written the slow obvious way."""
    B, T = c["reward"].shape
    adv = np.zeros((B, T))
    for b in range(B):
        last = 0.0
        for t in reversed(range(T)):
            if c["truncated"][b, t]:
                nxt = c["bootstrap_value"][b, t]
            elif t + 1 < T:
                nxt = c["value"][b, t + 1]
            else:
                nxt = c["next_value"][b]
            not_term = 0.0 if c["terminated"][b, t] else 1.0
            done = c["terminated"][b, t] or c["truncated"][b, t]
            delta = c["reward"][b, t] + gamma * not_term * nxt - c["value"][b, t]
            last = delta + gamma * lam * (0.0 if done else 1.0) * last
            adv[b, t] = last
    return adv


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("gamma", "lam"), [(0.99, 0.95), (0.999, 1.0), (0.9, 0.0)])
def test_gae_matches_reference(seed: int, gamma: float, lam: float) -> None:
    c = random_chains(seed)
    adv, target = gae(**c, discount=gamma, gae_lambda=lam)
    np.testing.assert_allclose(adv, reference_gae(c, gamma, lam), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target, adv + c["value"], rtol=1e-6, atol=1e-6)


def test_truncation_bootstraps_and_termination_does_not() -> None:
    base = dict(reward=np.ones((1, 1), np.float32), value=np.zeros((1, 1), np.float32),
                bootstrap_value=np.full((1, 1), 10.0, np.float32), next_value=np.full(1, 5.0, np.float32))
    term, _ = gae(**base, terminated=np.ones((1, 1), bool), truncated=np.zeros((1, 1), bool), discount=0.5, gae_lambda=1)
    trunc, _ = gae(**base, terminated=np.zeros((1, 1), bool), truncated=np.ones((1, 1), bool), discount=0.5, gae_lambda=1)
    cont, _ = gae(**base, terminated=np.zeros((1, 1), bool), truncated=np.zeros((1, 1), bool), discount=0.5, gae_lambda=1)
    assert term[0, 0] == pytest.approx(1.0)       # no bootstrap
    assert trunc[0, 0] == pytest.approx(1.0 + 5.0)  # bootstraps from the final observation's value
    assert cont[0, 0] == pytest.approx(1.0 + 2.5)   # bootstraps from the next observation


def reference_vtrace(c, blogp, tlogp, gamma, lam=1.0, rho_clip=1.0, c_clip=1.0):
    """Espeholt et al. 2018, eq. (1) with remark 4.2's lambda, as a plain per-step loop:
    v_s = V_s + sum_t gamma^(t-s) (prod_{i<t} c_i) rho_t delta_t,  c_i = lambda min(c_clip, ratio)."""
    B, T = c["reward"].shape
    ratio = np.exp(tlogp - blogp)
    rho, cs = np.minimum(rho_clip, ratio), lam * np.minimum(c_clip, ratio)
    vs = np.zeros((B, T))
    adv = np.zeros((B, T))
    for b in range(B):
        for s in range(T):
            total, trace = 0.0, 1.0
            for t in range(s, T):
                nxt = c["bootstrap_value"][b, t] if c["truncated"][b, t] else (
                    c["value"][b, t + 1] if t + 1 < T else c["next_value"][b])
                not_term = 0.0 if c["terminated"][b, t] else 1.0
                total += (gamma ** (t - s)) * trace * rho[b, t] * (
                    c["reward"][b, t] + gamma * not_term * nxt - c["value"][b, t])
                if c["terminated"][b, t] or c["truncated"][b, t]:
                    break  # the trace never crosses an episode boundary
                trace *= cs[b, t]
            vs[b, s] = c["value"][b, s] + total
        for t in range(T):
            nxt = c["bootstrap_value"][b, t] if c["truncated"][b, t] else (
                vs[b, t + 1] if t + 1 < T else c["next_value"][b])
            not_term = 0.0 if c["terminated"][b, t] else 1.0
            # PPO's ratio is the importance weight: no rho_t in front (the paper's actor-critic has one)
            adv[b, t] = c["reward"][b, t] + gamma * not_term * nxt - c["value"][b, t]
    return adv, vs


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("lam", "rho_clip", "c_clip"), [(1.0, 1.0, 1.0), (0.9, 2.0, 0.8), (0.5, 0.5, 1.5)])
def test_vtrace_matches_the_papers_definition(seed: int, lam: float, rho_clip: float, c_clip: float) -> None:
    c = random_chains(seed, T=21)
    rng = np.random.default_rng(100 + seed)
    blogp = rng.normal(-1, 0.4, c["reward"].shape).astype(np.float32)
    tlogp = rng.normal(-1, 0.4, c["reward"].shape).astype(np.float32)
    adv, vs = vtrace(**c, behaviour_logp=blogp, target_logp=tlogp, discount=0.97, gae_lambda=lam,
                     rho_clip=rho_clip, c_clip=c_clip)
    ref_adv, ref_vs = reference_vtrace(c, blogp, tlogp, 0.97, lam, rho_clip, c_clip)
    np.testing.assert_allclose(vs, ref_vs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-4, atol=1e-4)


def test_vtrace_advantage_has_no_second_importance_weight() -> None:
    # One step, terminated: v = V + rho * delta, and the PPO advantage is r - V whatever the ratio
    # (the surrogate multiplies it by pi/mu itself).
    one = dict(reward=np.full((1, 1), 2.0, np.float32), value=np.zeros((1, 1), np.float32),
               terminated=np.ones((1, 1), bool), truncated=np.zeros((1, 1), bool),
               bootstrap_value=np.zeros((1, 1), np.float32), next_value=np.zeros(1, np.float32))
    adv, vs = vtrace(**one, behaviour_logp=np.log(np.full((1, 1), 0.8, np.float32)),
                     target_logp=np.log(np.full((1, 1), 0.2, np.float32)), discount=0.9)
    assert vs[0, 0] == pytest.approx(0.25 * 2.0)
    assert adv[0, 0] == pytest.approx(2.0)


@pytest.mark.parametrize("lam", [1.0, 0.8])
def test_vtrace_on_policy_targets_are_gae_lambda_returns(lam: float) -> None:
    c = random_chains(7)
    logp = np.full(c["reward"].shape, -0.5, np.float32)
    adv, vs = vtrace(**c, behaviour_logp=logp, target_logp=logp, discount=0.95, gae_lambda=lam)
    gae_adv, target = gae(**c, discount=0.95, gae_lambda=lam)
    np.testing.assert_allclose(vs, target, rtol=1e-5, atol=1e-5)
    if lam == 1.0:  # Monte-Carlo returns: the one-step advantage over v_{t+1} is GAE(1)'s
        np.testing.assert_allclose(adv, gae_adv, rtol=1e-4, atol=1e-4)
