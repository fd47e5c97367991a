"""`overworld serve run-controller` / `python -m overworld.run_controller`: the kopf operator for
TrainingRuns (no gRPC server of its own: its flags are the operator's)."""

from __future__ import annotations

import argparse

SUMMARY = "Kubernetes operator for TrainingRun (trainingruns.overworld.dev): makes the trainer's RayJobs."
ENVIRONMENT = {
    "OVERWORLD_TRAINER_ADDRESS": "where it reads a run's trainer status: a template with {cluster}, {namespace}, "
                                 "{port} (default: the RayJob's head service)",
    "OVERWORLD_TRAINER_PORT": "the trainer's gRPC port on the Ray head (default 50055)",
    "OVERWORLD_PROGRESS_INTERVAL": "seconds between two reads of a run's progress (default 30)",
    "OVERWORLD_TLS_DIR": "its identity when it reads the trainer's status (mutual TLS)",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    from overworld.run_controller.operator import add_flags as add_operator_flags

    add_operator_flags(p)


def run(args: argparse.Namespace) -> int:
    from overworld.run_controller.operator import run as run_operator

    return run_operator(args)
