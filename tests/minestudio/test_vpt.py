"""MineStudio's real VPTPolicy (random weights, small sizes) behind overworld's Policy, and a rollout
worker running a MinecraftSim stand-in with it. Needs `minestudio` (make test-minestudio)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("minestudio", reason="minestudio is not installed in this venv: `make test-minestudio` "
                                         "installs it in .venv-minestudio and runs these tests")

import torch  # noqa: E402

from overworld.envs.minestudio import adapt_env  # noqa: E402
from overworld.policies.base import entropy, kl_divergence, log_prob, sample  # noqa: E402
from overworld.policies.minestudio import MinePolicyAdapter, as_policy  # noqa: E402
from tests.minestudio import minecraft_sim_standin  # noqa: E402
from tests.minestudio.quick_start import run_quick_start  # noqa: E402

pytestmark = pytest.mark.minestudio


def make_policy() -> tuple[MinePolicyAdapter, object]:
    torch.manual_seed(0)
    mine = minecraft_sim_standin.policy_generator()
    env = adapt_env(minecraft_sim_standin.env_generator())
    return as_policy(mine, env.action_space), env  # type: ignore[return-value]


def test_vpt_behind_the_policy_interface() -> None:
    policy, env = make_policy()
    B, T = 3, 5
    size = minecraft_sim_standin.SIZE
    obs = {"image": torch.randint(0, 256, (B, T, size, size, 3), dtype=torch.uint8)}
    state = policy.initial_state(B)
    assert state and all(v.shape[0] == B for v in state.values())
    first = torch.zeros(B, T, dtype=torch.bool)
    out, new_state = policy(obs, state, first)
    assert out.logits["buttons"].shape == (B, T, 8641) and out.logits["camera"].shape == (B, T, 121)
    assert out.vpred.shape == (B, T) and set(new_state) == set(state)
    # log-probs, entropy and KL are MineStudio's pi_head's, to float precision
    action = sample(out.logits)
    pi_logits = {k: v.unsqueeze(2) for k, v in out.logits.items()}
    ms_action = {k: v.unsqueeze(-1) for k, v in action.items()}
    torch.testing.assert_close(log_prob(out.logits, action), policy.mine.pi_head.logprob(ms_action, pi_logits))
    torch.testing.assert_close(entropy(out.logits), policy.mine.pi_head.entropy(pi_logits))
    torch.testing.assert_close(kl_divergence(out.logits, out.logits), torch.zeros(B, T), atol=1e-5, rtol=0)
    # MineStudio's merge_state / split_state round trip
    parts = policy.split_states(new_state, B)
    merged = policy.merge_states(parts)
    for k in new_state:
        torch.testing.assert_close(merged[k], new_state[k])
    # `first` resets the memory inside a sequence (VPTPolicy.forward ignores it; we do not)
    warm, _ = policy(obs, new_state, torch.zeros(B, T, dtype=torch.bool))
    reset_first = torch.zeros(B, T, dtype=torch.bool)
    reset_first[:, 0] = True
    reset_out, _ = policy(obs, new_state, reset_first)
    fresh, _ = policy(obs, policy.initial_state(B), reset_first)
    torch.testing.assert_close(reset_out.vpred, fresh.vpred)
    assert not torch.allclose(warm.vpred, reset_out.vpred)
    # the value head is MineStudio's (zero_initial_vf zeroes it)
    assert policy.value_head_modules() == [policy.mine.value_head]


def test_rollout_worker_runs_minestudio_generators(make_cluster_from_file, tmp_path: Path) -> None:
    run_quick_start(make_cluster_from_file, tmp_path, "policy_generator")  # MineStudio's real VPTPolicy


def test_actions_come_from_pi_head_sample_with_its_nucleus_setting() -> None:
    policy, _ = make_policy()
    size = minecraft_sim_standin.SIZE
    obs = {"image": torch.randint(0, 256, (4, 1, size, size, 3), dtype=torch.uint8)}
    out, _ = policy(obs, policy.initial_state(4), torch.zeros(4, 1, dtype=torch.bool))
    heads = dict(policy.mine.pi_head.items())
    assert set(heads) == {"buttons", "camera"}
    for head in heads.values():
        head.nucleus_prob = 1e-9  # the nucleus holds only the most likely action
    for _ in range(3):
        action, logp = policy.sample_actions(out.logits)
        for k, v in out.logits.items():
            assert torch.equal(action[k], v[:, 0].argmax(-1)), k
        pi_logits = {k: v.unsqueeze(2) for k, v in out.logits.items()}
        expected = policy.mine.pi_head.logprob({k: a.view(4, 1, 1) for k, a in action.items()}, pi_logits)
        torch.testing.assert_close(logp, expected.reshape(-1).float())
    for head in heads.values():
        head.nucleus_prob = None  # vanilla sampling: not always the most likely action
    samples = [policy.sample_actions(out.logits)[0]["camera"] for _ in range(20)]
    assert any(not torch.equal(s, out.logits["camera"][:, 0].argmax(-1)) for s in samples)


@pytest.mark.parametrize("name", ["config_shoot", "gate", "gate_kl"])
def test_every_online_config_minestudio_ships_loads_verbatim(name: str) -> None:
    import importlib.util

    from overworld.core.config import load_config

    package = Path(importlib.util.find_spec("minestudio").origin).parent  # type: ignore[union-attr, arg-type]
    path = package / "online" / "run" / "config" / f"{name}.py"  # importing it would need cv2, ray, hydra
    config = load_config(path)  # config_shoot.py imports ray, hydra and wandb at the top: not run to read it
    assert config.train_config.kl_divergence_coef_rho == 0.2 and config.train_config.resume is None
    assert config.env_generator == f"{path.resolve()}:env_generator" and config.logger_config.wandb is True
