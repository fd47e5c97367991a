"""The run-controller: a kopf operator for the ``TrainingRun`` custom resource.

A TrainingRun (``trainingruns.overworld.dev/v1alpha1``) describes one training run. The
controller turns it into a KubeRay ``RayJob`` (head + GPU worker group) running
``overworld serve trainer --ray-address auto``, starts a new attempt resuming from a
checkpoint whenever ``spec.resumeFrom`` changes, and mirrors the job's phase and the
trainer's progress into the TrainingRun's status (``kubectl get trainingrun``).

Entry points: ``python -m overworld.run_controller [--namespace NS] [--liveness URL]`` and
:func:`main` (``overworld serve run-controller``), which takes its settings from the
environment (``OVERWORLD_NAMESPACE``, ``OVERWORLD_LIVENESS``) unless given ``argv``.
"""

from collections.abc import Sequence

from overworld.run_controller.rayjob import (
    ATTEMPT_LABEL,
    RUN_LABEL,
    build_rayjob,
    rayjob_name,
    trainer_entrypoint,
)

__all__ = ["ATTEMPT_LABEL", "RUN_LABEL", "build_rayjob", "main", "rayjob_name", "trainer_entrypoint"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the operator until SIGTERM; ``argv`` are its own flags (none: the environment's)."""
    from overworld.run_controller.operator import main as operator_main

    return operator_main(list(argv) if argv is not None else [])
