"""The trainer's built-in behaviours, each a hook at a named point (see hooks.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from overworld.core.blobs.urls import open_blob_store
from overworld.core.config import as_dict
from overworld.trainer.checkpoint import is_durable, save_location
from overworld.trainer.evaluation import evaluate
from overworld.trainer.hooks import Runtime
from overworld.trainer.loggers import LogSync, build_loggers
from overworld.trainer.minestudio_metrics import MineStudioMetrics

log = logging.getLogger("overworld.trainer")


def publish_weights(trainer: Runtime, metrics: dict[str, float]) -> None:
    # During the value warm-up (its first vf_warmup iterations) MineStudio broadcasts nothing.
    if trainer.iteration > trainer.config.train_config.vf_warmup:
        trainer.broadcast_model_to_rollout_workers(new_version=True)


def save_checkpoint(trainer: Runtime, metrics: dict[str, float]) -> None:
    # Every rank: each one's RNG state goes into the checkpoint (rank 0 writes it).
    t = trainer.config.train_config
    if t.save_interval > 0 and trainer.iteration % t.save_interval == 0:
        ckpt_id = trainer.save_checkpoint()
        if trainer.rank == 0:
            trainer.hooks.run("on_checkpoint", trainer, checkpoint_id=ckpt_id)


def run_evaluation(trainer: Runtime, metrics: dict[str, float]) -> None:
    t = trainer.config.train_config
    if trainer.rank == 0 and t.eval_interval > 0 and trainer.iteration % t.eval_interval == 0:
        model = trainer.unwrapped_model
        model.eval()
        results = evaluate(model, trainer.config, t.eval_episodes, seed=10_000 + trainer.iteration,
                           device=trainer.device)
        model.train()
        metrics.update(results)
        trainer.hooks.run("on_evaluate", trainer, results=results)


def request_video(trainer: Runtime, metrics: dict[str, float]) -> None:
    """Every record_video_interval iterations, ask the rollout-manager for an MP4 of an episode."""
    interval = trainer.config.train_config.record_video_interval
    if trainer.rank == 0 and interval > 0 and trainer.iteration % interval == 0:
        try:
            trainer.manager.request_video(trainer.iteration)
        except Exception as err:  # a missed video never stops training
            log.warning("video request failed: %s", err)


class LogMetrics:
    """Console / TensorBoard / W&B every log_interval (the driver's status, and so Prometheus, gets
    every iteration from the loop itself). Their files are written under <workdir>/logs/<run_id>/ and,
    when save_path is durable, copied to <save_path>/<run_id>/logs/ every minute, at every checkpoint
    and at the end."""

    def __init__(self, trainer: Runtime) -> None:
        self.loggers = []
        self.sync: LogSync | None = None
        if trainer.rank == 0:
            run_id = trainer.config.run_id or "run"
            run_dir = Path(trainer.workdir) / "logs" / run_id
            self.loggers = build_loggers(trainer.config.logger_config, run_dir,
                                         trainer.config.train_config.num_iterations, as_dict(trainer.config))
            if is_durable(trainer.config):
                self.sync = LogSync(run_dir, open_blob_store(save_location(trainer.config, trainer.workdir)),
                                    f"{run_id}/logs")

    def __call__(self, trainer: Runtime, metrics: dict[str, float]) -> None:
        if trainer.iteration % trainer.config.train_config.log_interval:
            return
        for logger in self.loggers:
            logger.log(metrics, trainer.iteration)
        if self.sync is not None:
            self.sync.maybe()

    def on_checkpoint(self, trainer: Runtime, checkpoint_id: str) -> None:
        if self.sync is not None:
            self.sync.sync()

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        if self.sync is not None:
            self.sync.sync()


def register_builtin_hooks(trainer: Runtime) -> LogMetrics:
    trainer.hooks.register("post_iteration", publish_weights)
    trainer.hooks.register("post_iteration", save_checkpoint)
    trainer.hooks.register("post_iteration", run_evaluation)
    trainer.hooks.register("post_iteration", request_video)
    trainer.hooks.register("post_iteration", MineStudioMetrics())
    logger = LogMetrics(trainer)
    trainer.hooks.register("post_iteration", logger)
    trainer.hooks.register("on_checkpoint", logger.on_checkpoint)
    return logger
