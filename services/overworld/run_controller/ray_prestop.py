"""preStop hook of the trainer's Ray head pod: stop the running Ray jobs and wait for them.

Kubernetes sends SIGTERM to the head container's main process (`ray start`), never to the trainer,
which Ray runs as the job's entrypoint; without this hook a deleted head pod (drain, eviction,
`kubectl delete pod`) kills the trainer after the grace period without a checkpoint. Ray's job API
sends the entrypoint SIGTERM and waits RAY_JOB_STOP_WAIT_TIME_S before SIGKILL; the trainer
checkpoints after its current iteration and exits. This hook returns once every job it stopped has
ended, or after --timeout seconds.

    python -m overworld.run_controller.ray_prestop --dashboard http://127.0.0.1:8265 --timeout 150
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dashboard", default="http://127.0.0.1:8265", help="Ray dashboard (job API) address")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds to wait for the jobs to end")
    parser.add_argument("--stop-ray", action="store_true", help="then kill this node's Ray processes")
    args = parser.parse_args(argv)
    code = 0
    try:
        left = stop_jobs(args.dashboard, args.timeout)
        if left:
            print(f"still running after {args.timeout:.0f}s: {', '.join(left)}", file=sys.stderr, flush=True)
            code = 1
    except Exception as err:  # the head is going away anyway: say why, never block the deletion
        print(f"could not stop the Ray jobs: {err}", file=sys.stderr, flush=True)
        code = 1
    if args.stop_ray:
        subprocess.run(["ray", "stop", "--force"], check=False, timeout=60)
    return code


if __name__ == "__main__":
    sys.exit(main())
