"""The stand-in GPU box: the documented call (docs/gpu_check.md) run here as the device tool runs it.

    python -m bench.gpu.box_standin [--budget 150] [--dir runs/gpu-check-stand-in]    (make gpu-check)

As the tool does: a copy of what travels (tracked files, untracked ones git does not ignore, and the
call's carry list), `bash -c COMMAND` in its root with $OUT an empty folder, every process of the command
SIGKILLed at the limit, and whatever it left running killed when it returns. Unlike the box: this
interpreter (CPU torch) stands in for the box's python3, seeing only the box's packages
(bench/gpu/box.py; no make on the PATH), the carry is built for it, the steps run at tiny sizes
(GPU_CHECK_STAND_IN=1), and the budget and the limit are shortened by the same margin.
tests/bench/test_gpu_check.py runs it, killed at a random moment too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.gpu import box, carry
from bench.gpu.outbox import read_json
from bench.gpu.plan import BOX, BUDGET_ENV, ROOT, STAND_IN, STAND_IN_ENV, documented_call

MARKER_ENV = "GPU_CHECK_STAND_IN_RUN"  # in every process the command starts: how leftovers are found
SHIM = """#!/bin/sh
# the stand-in box's python3: {python} with only the box's packages in sight (bench/gpu/box.py)
PYTHONPATH="{view}${{PYTHONPATH:+:$PYTHONPATH}}" exec {python} "$@"
"""
NO_MAKE = "#!/bin/sh\necho 'make: not on the GPU box' >&2\nexit 127\n"


@dataclass(frozen=True)
class StandInBox:
    root: Path  # the checkout as it travels, the command's working directory
    bin: Path  # python3 and make as the box has them, first on the PATH


@dataclass(frozen=True)
class CallRun:
    exit_code: int | None  # None: killed
    killed_at: float | None  # seconds after the start, when the limit or the caller killed it
    seconds: float
    output: str


def lay_out(dest: Path, carried_from: Path, checkout: Path = ROOT) -> Path:
    """Copy what a device call sends into dest: the travelling files of `checkout` and each path of the
    call's carry list, taken from `carried_from` (the stand-in's own build of them)."""
    shutil.rmtree(dest, ignore_errors=True)
    for path in carry.travelling_files(checkout):
        target = dest / path.relative_to(checkout)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    for name in documented_call()["carry"]:
        shutil.copytree(carried_from / name, dest / name)
    return dest


def prepare(directory: Path, checkout: Path = ROOT) -> StandInBox:
    """Build the carry for this interpreter, lay the checkout out as it travels, and the box's python3."""
    carried = directory / "carry"
    carry.build(carried / carry.CARRY_DIR, sys.version_info[:2], checkout)
    root = lay_out(directory / "root", carried, checkout)
    view = box.simulate(directory / "view")
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("python3", SHIM.format(python=sys.executable, view=view)), ("make", NO_MAKE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return StandInBox(root, bin_dir)


def marked_processes(marker: str) -> list[int]:
    found = []
    needle = f"{MARKER_ENV}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def kill_marked(marker: str) -> None:
    """SIGKILL every process the command started (they carry its marker), until none is left."""
    for _ in range(50):
        pids = marked_processes(marker)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def probe_ended(out: Path) -> bool:
    return (read_json(out / "probe.json") or {}).get("status") in ("ok", "failed")


def run_call(stand_in: StandInBox, out: Path, budget: float, kill_after_probe: float | None = None) -> CallRun:
    """The documented command in the stand-in box with `budget` seconds (the box's plan shortened); killed
    at the call's timeout_s shortened by the same margin, or `kill_after_probe` seconds after the probe's
    result is in $OUT."""
    call = documented_call()
    limit = budget + (call["timeout_s"] - BOX.budget)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)  # $OUT is emptied before each command
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK")}
    env.update({"PATH": f"{stand_in.bin}{os.pathsep}{env.get('PATH', '')}", "OUT": str(out), STAND_IN_ENV: "1",
                BUDGET_ENV: str(budget), MARKER_ENV: marker})
    env.pop("PYTHONPATH", None)
    log = out.parent / f"{out.name}-output.log"
    began = time.monotonic()
    with log.open("wb") as output:
        proc = subprocess.Popen(["bash", "-c", call["command"]], cwd=stand_in.root, env=env, stdin=subprocess.DEVNULL,
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        kill_at = began + limit
        code = proc.poll()
        while code is None and time.monotonic() < kill_at:
            if kill_after_probe is not None and probe_ended(out):
                kill_at, kill_after_probe = min(kill_at, time.monotonic() + kill_after_probe), None
            time.sleep(0.1)
            code = proc.poll()
        killed_at = None
        if code is None:
            killed_at = round(time.monotonic() - began, 1)
            kill_marked(marker)  # the command and everything in its pipeline, at once
            proc.wait()
    kill_marked(marker)  # what a command leaves running is killed when it returns
    return CallRun(code, killed_at, round(time.monotonic() - began, 1), log.read_text(errors="replace"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=ROOT / "runs" / "gpu-check-stand-in")
    p.add_argument("--budget", type=float, default=STAND_IN.budget)
    args = p.parse_args(argv)
    stand_in = prepare(args.dir.resolve())
    run = run_call(stand_in, args.dir.resolve() / "out", args.budget)
    print(run.output[-6000:])
    print(f"the call {'exited ' + str(run.exit_code) if run.killed_at is None else 'was killed'} after "
          f"{run.seconds:.0f}s; its files: {args.dir / 'out'}")
    from bench.gpu import collect

    return collect.main([str(args.dir / "out"), "--results", str(args.dir / "results")])


if __name__ == "__main__":
    sys.exit(main())
