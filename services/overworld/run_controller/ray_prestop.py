"""preStop hook of the trainer's Ray pods.

The head (`--dashboard`): stop the running Ray jobs and wait for them. Kubernetes sends SIGTERM to the
head container's main process (`ray start`), never to the trainer, which Ray runs as the job's
entrypoint; without this hook a deleted head pod (drain, eviction, `kubectl delete pod`) kills the
trainer after the grace period without a checkpoint. Ray's job API sends the entrypoint SIGTERM and
waits RAY_JOB_STOP_WAIT_TIME_S before SIGKILL; the trainer reads its grace period, checkpoints and
exits. This hook returns once every job it stopped has ended, or after --timeout seconds.

A worker (`--trainer-port`): its node is going (a spot reclaim, a drain), and with it a learner rank.
Ask the trainer's driver, on the head (KubeRay gives every worker the head Service's name in
FQ_RAY_IP), to checkpoint within --timeout seconds and end the attempt as failed, so that KubeRay's
retry resumes from that checkpoint; wait until it has ended, or --timeout.

    python -m overworld.run_controller.ray_prestop --dashboard http://127.0.0.1:8265 --timeout 150 --stop-ray
    python -m overworld.run_controller.ray_prestop --trainer-port 50055 --timeout 150 --stop-ray
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def stop_jobs(dashboard: str, timeout: float) -> list[str]:
    """Stop every job that has not ended; return the ids of those still running at the deadline."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(dashboard)
    running = [job.submission_id for job in client.list_jobs()
               if job.submission_id and not job.status.is_terminal()]
    for submission_id in running:
        print(f"stopping Ray job {submission_id}", flush=True)
        client.stop_job(submission_id)
    deadline = time.monotonic() + timeout
    while running and time.monotonic() < deadline:
        time.sleep(1.0)
        running = [s for s in running if not client.get_job_status(s).is_terminal()]
    return running


def stop_trainer(address: str, timeout: float) -> bool:
    """Ask the trainer at `address` to checkpoint within `timeout` and end its attempt; True once it has
    ended (its status says so, or its driver is gone) within `timeout`."""
    import grpc

    from overworld.trainer.client import TrainerClient

    deadline = time.monotonic() + timeout
    with TrainerClient(address) as trainer:

        def ended() -> bool:
            try:
                return trainer.status(timeout=2.0).state in ("finished", "failed")
            except grpc.RpcError:
                return True  # no driver: the attempt has ended (its RayCluster is going with it)

        if ended():
            return True
        trainer.request_stop(timeout, f"Ray worker pod {socket.gethostname()} is stopping", timeout=min(10.0, timeout))
        print(f"asked the trainer at {address} to checkpoint within {timeout:.0f}s", flush=True)
        while time.monotonic() < deadline:
            if ended():
                return True
            time.sleep(1.0)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--dashboard", default="http://127.0.0.1:8265", help="the head: Ray dashboard (job API) address")
    which.add_argument("--trainer-port", type=int, help="a worker: the trainer driver's port on the head ($FQ_RAY_IP)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds to wait for the jobs to end")
    parser.add_argument("--stop-ray", action="store_true", help="then kill this node's Ray processes")
    args = parser.parse_args(argv)
    code = 0
    try:
        if args.trainer_port:
            head = os.environ.get("FQ_RAY_IP", "")
            if not head:
                raise RuntimeError("FQ_RAY_IP is not set: KubeRay names the head Service there on worker pods")
            if not stop_trainer(f"{head}:{args.trainer_port}", args.timeout):
                print(f"the trainer had not ended after {args.timeout:.0f}s", file=sys.stderr, flush=True)
                code = 1
        else:
            left = stop_jobs(args.dashboard, args.timeout)
            if left:
                print(f"still running after {args.timeout:.0f}s: {', '.join(left)}", file=sys.stderr, flush=True)
                code = 1
    except Exception as err:  # the pod is going away anyway: say why, never block the deletion
        print(f"could not stop the trainer: {err}", file=sys.stderr, flush=True)
        code = 1
    if args.stop_ray:
        subprocess.run(["ray", "stop", "--force"], check=False, timeout=60)
    return code


if __name__ == "__main__":
    sys.exit(main())
