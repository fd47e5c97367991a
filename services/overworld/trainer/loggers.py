"""Metric loggers: console (with a progress bar on a terminal), TensorBoard, Weights & Biases
(offline mode works with no network). Prometheus gets the same numbers through the trainer driver."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any, Protocol

from overworld.core.config import LoggerConfig

log = logging.getLogger("overworld.trainer")


class MetricLogger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class ConsoleLogger:
    KEYS = ("trainer/total_loss", "trainer/policy_loss", "trainer/value_loss", "trainer/approx_kl",
            "trainer/explained_var", "trainer/utd_ratio")

    def __init__(self, total: int) -> None:
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="iterations", unit="it", file=sys.stderr)

    def log(self, metrics: dict[str, float], step: int) -> None:
        shown = {k.split("/", 1)[1]: v for k, v in metrics.items() if k in self.KEYS and not math.isnan(v)}
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()})
        else:
            log.info("iteration %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in shown.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class TensorBoardLogger:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, config: LoggerConfig, run_dir: Path, run_config: dict[str, Any]) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=config.project, name=config.name, mode=config.wandb_mode,  # type: ignore[arg-type]
                              dir=str(run_dir), config=run_config, reinit="finish_previous")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def build_loggers(config: LoggerConfig, run_dir: Path, total_iterations: int,
                  run_config: dict[str, Any]) -> list[MetricLogger]:
    loggers: list[MetricLogger] = []
    if config.console:
        loggers.append(ConsoleLogger(total_iterations))
    if config.tensorboard:
        loggers.append(TensorBoardLogger(run_dir / "tensorboard"))
    if config.wandb:
        loggers.append(WandbLogger(config, run_dir, run_config))
    return loggers
