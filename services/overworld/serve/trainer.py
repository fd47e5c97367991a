"""`overworld serve trainer` / `python -m overworld.trainer`: the trainer's driver (Ray, Ray Train, its
status service)."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

from overworld.serve import (
    DEFAULT_PORTS,
    S3_ENVIRONMENT,
    SERVER_ENVIRONMENT,
    add_server_flags,
    address_flag,
    env_flag,
)

SUMMARY = ("The trainer's driver: starts (or joins) Ray, runs the learners with Ray Train, publishes each "
           "version, checkpoints, and serves Trainer/GetStatus.")
DEFAULT_PORT = DEFAULT_PORTS["trainer"]
ENVIRONMENT = {
    **SERVER_ENVIRONMENT, **S3_ENVIRONMENT,
    "POD_IP": "the address the learners reach the driver's status service at (default: this host's)",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    add_server_flags(p, DEFAULT_PORT)
    env_flag(p, "--config", "", "the trainer's own run config (default: the rollout-manager's)")
    address_flag(p, "rollout-manager")
    address_flag(p, "replay-buffer")
    address_flag(p, "gae")
    address_flag(p, "model-registry")
    env_flag(p, "--ray-address", "", "empty: start a local Ray; auto: join the cluster (RayJob)")
    env_flag(p, "--resume", "", "latest, auto, a checkpoint id, or a MineStudio checkpoint directory")
    env_flag(p, "--save-path", "", "replaces train_config.save_path")
    env_flag(p, "--workdir", ".", "checkpoints and logs when local")
    env_flag(p, "--stop-grace-seconds", 0.0, "seconds a SIGTERM leaves this process (the pod's grace period): "
             "an update that would outlast them is cut short to checkpoint in time; 0: finish the iteration")


def build(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.trainer.driver import TrainerDriver

    return TrainerDriver(args.rollout_manager, args.replay_buffer, args.gae, args.model_registry, args.host,
                         args.port, args.ray_address, str(Path(args.workdir).resolve()), args.resume, done,
                         config_path=args.config, save_path=args.save_path,
                         stop_grace=args.stop_grace_seconds)
