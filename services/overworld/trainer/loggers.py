"""Metric loggers: console (with a progress bar on a terminal), TensorBoard, Weights & Biases.
Prometheus gets the same numbers through the trainer driver.

W&B as MineStudio runs it: logger_config goes to wandb.init as given, and the x-axes are
MineStudio's (`trainer/*` against `trainer/env_steps_all_workers`, `episode_statistics/*` against
`episode_statistics/step`). Without an API key, or when the server cannot be reached, the run is
logged offline (one notice; `wandb sync` uploads it later) instead of failing the trainer.

TensorBoard and W&B write files under the workdir; when `save_path` is durable (an object store, a
mounted volume), `LogSync` copies them there, next to the checkpoints, so a pod's death cannot take
them (see docs/trainer.md)."""

from __future__ import annotations

import logging
import math
import netrc
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from overworld.core.blobs.store import BlobStore
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


# MineStudio's define_metric calls (ppotrainer.py, episode_statistics.py).
STEP_METRICS = {"trainer/*": "trainer/env_steps_all_workers", "episode_statistics/*": "episode_statistics/step"}


def wandb_api_key_missing() -> bool:
    """True when neither WANDB_API_KEY nor a netrc entry for the W&B host holds a key."""
    if os.environ.get("WANDB_API_KEY"):
        return False
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        return netrc.netrc().authenticators(host) is None
    except (OSError, netrc.NetrcParseError):
        return True


class WandbLogger:
    def __init__(self, config: LoggerConfig, run_dir: Path, run_config: dict[str, Any]) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {"project": config.project, "name": config.name, "dir": str(run_dir),
                                  "config": run_config, "reinit": "finish_previous", **config.wandb_init}
        mode = kwargs.get("mode") or os.environ.get("WANDB_MODE") or "online"
        if mode == "online" and wandb_api_key_missing():
            log.warning("W&B: no API key (WANDB_API_KEY or `wandb login`): logging offline to %s; "
                        "`wandb sync` uploads it later", run_dir)
            kwargs["mode"] = "offline"
        try:
            self.run = wandb.init(**kwargs)
        except Exception as err:  # the server is unreachable: keep the metrics, do not fail training
            if kwargs.get("mode") == "offline":
                raise
            log.warning("W&B: cannot reach the server (%s): logging offline to %s; `wandb sync` uploads it "
                        "later", str(err).splitlines()[0][:200], run_dir)
            self.run = wandb.init(**{**kwargs, "mode": "offline"})
        self.run.define_metric("episode_statistics/step")
        for pattern, step_metric in STEP_METRICS.items():
            self.run.define_metric(pattern, step_metric=step_metric)

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


class LogSync:
    """Copies the files under `local_dir` that changed since the last copy to `prefix/` in `store`
    (every `interval` seconds when asked with `maybe()`, and on `sync()`). A failed copy is logged
    and tried again next time: logs never stop training."""

    def __init__(self, local_dir: Path, store: BlobStore, prefix: str, interval: float = 60.0) -> None:
        self.local_dir = local_dir
        self.store = store
        self.prefix = prefix.rstrip("/")
        self.interval = interval
        self.copied: dict[Path, tuple[int, int]] = {}
        self.last = time.monotonic()

    def maybe(self) -> None:
        if time.monotonic() - self.last >= self.interval:
            self.sync()

    def sync(self) -> int:
        self.last = time.monotonic()
        copied = 0
        for path in sorted(p for p in self.local_dir.rglob("*") if p.is_file()):
            try:
                stat = path.stat()
                version = (stat.st_size, stat.st_mtime_ns)
                if self.copied.get(path) == version:
                    continue
                self.store.put(f"{self.prefix}/{path.relative_to(self.local_dir).as_posix()}", path.read_bytes())
                self.copied[path] = version
                copied += 1
            except Exception as err:  # a vanished temp file, the store away: next time
                log.warning("could not copy %s to the save path: %s", path, err)
        return copied
