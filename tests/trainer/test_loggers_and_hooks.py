from pathlib import Path

import pytest
import torch

from overworld.core.config import LoggerConfig
from overworld.trainer.evaluation import evaluate
from overworld.trainer.hooks import Hooks
from overworld.trainer.loggers import build_loggers
from tests.trainer.helpers import make_trainer


def test_tensorboard_and_offline_wandb_write_their_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = LoggerConfig(project="p", name="n", console=True, tensorboard=True, wandb=True,
                          wandb_init={"mode": "offline"})
    loggers = build_loggers(config, tmp_path, total_iterations=3, run_config={"seed": 1})
    for step in (1, 2):
        for logger in loggers:
            logger.log({"trainer/total_loss": 0.5 / step, "trainer/approx_kl": 0.01}, step)
    for logger in loggers:
        logger.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_hooks_run_in_order_and_unknown_points_are_refused() -> None:
    hooks = Hooks()
    calls: list[str] = []
    hooks.register("post_iteration", lambda t, metrics: calls.append(f"a{metrics['x']}"))
    hooks.register("post_iteration", lambda t, metrics: calls.append("b"))
    hooks.run("post_iteration", object(), metrics={"x": 1})
    assert calls == ["a1", "b"]
    with pytest.raises(ValueError, match="unknown hook point"):
        hooks.register("post_lunch", lambda t: None)


def test_evaluation_on_a_separate_env() -> None:
    trainer = make_trainer("train_config.eval_episodes=2")
    results = evaluate(trainer.unwrapped_model, trainer.config, episodes=2, seed=5, device=torch.device("cpu"))
    assert results["eval/episodes"] == 2 and results["eval/mean_length"] >= 8
    assert results["eval/mean_return"] == results["eval/mean_length"]  # CartPole: +1 per step
