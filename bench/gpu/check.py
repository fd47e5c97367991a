"""The GPU check: everything one device call can measure, back in that call (docs/gpu_check.md).

    python3 -m bench.gpu.check --out "$OUT"

1. probe     Python, the host, nvidia-smi, the carried wheels installed (gpu-wheels/ -> .gpu-site/),
             then in a child: torch, CUDA and every import the steps need. Written to $OUT/probe.json
             before anything else; the command ends there (exit 3) when the steps cannot run.
2. rollout   a rollout worker's env steps/s with inference on CUDA, then on the CPU (bench.gpu.steps);
3. vpt2x     one PPO iteration of a VPT-2x-sized policy under bf16 autocast;
4. amp_fp16  fp16 autocast with a GradScaler, through a checkpoint and a resume;
5. crafter   examples/crafter_resnet.yaml for whatever time is left (bench.gpu.crafter).

Each step runs in a child process with a limit; its output goes line by line to $OUT/check.log, and
the moment it ends its result, status and log tail are in $OUT/<step>.json, so a command killed at
the tool's limit still brings back every step done. The plan (bench/gpu/plan.py) ends the command by
itself 8.5 minutes after it started, the install included. Standard library only: the box's Python
3.12 runs it before anything is installed; `python -m bench.gpu.collect` makes the results of the files.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.gpu.digest import code_digest
from bench.gpu.outbox import Outbox, read_json
from bench.gpu.plan import DRIVER_ENV, ROOT, STEPS, WORKDIR, Plan, current_plan, stand_in, started_at

CARRY = ROOT / "gpu-wheels"
SITE = ROOT / ".gpu-site"
TAIL_LINES = 40
TAIL_CHARS = 4000
KILL_GRACE = 3.0  # seconds between a child's SIGTERM and its SIGKILL


def first_line(cmd: list[str]) -> str | None:
    """The first line `cmd` prints, None when it is not there or fails."""
    if not shutil.which(cmd[0]):
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def host_facts() -> dict[str, Any]:
    def meminfo_gib() -> float | None:
        try:
            kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal"))
        except (OSError, StopIteration):
            return None
        return round(kib / 2**20, 1)

    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown"
    gpu = first_line(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    name, driver, memory = ([s.strip() for s in gpu.split(",")] + [None, None])[:3] if gpu else (None, None, None)
    return {"python": platform.python_version(), "executable": sys.executable, "machine": platform.machine(),
            "libc": " ".join(platform.libc_ver()), "kernel": os.uname().release, "cpu": cpu, "cpus": os.cpu_count(),
            "memory_gib": meminfo_gib(), "gpu": name, "driver": driver, "gpu_memory": memory,
            "tools": {t: first_line([t, "--version"]) for t in ("make", "git", "nvcc", "nvidia-smi")},
            "code_digest": code_digest(ROOT)}


def install_carry(carry: Path = CARRY, site: Path = SITE, python: str = sys.executable) -> dict[str, Any]:
    """The carried wheels into `site` (pip --target, no index), once per set of wheels."""
    wheels = sorted(carry.glob("*.whl"))
    record: dict[str, Any] = {"wheels": [w.name for w in wheels], "site": str(site)}
    if not wheels:
        record["error"] = f"{carry.name}/ holds no wheels: build it with `make gpu-wheels` and name it in carry"
        return record
    stamp = site / ".installed"
    if stamp.exists() and stamp.read_text() == "\n".join(record["wheels"]):
        return {**record, "exit_code": 0, "already_installed": True}
    began = time.monotonic()
    done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)],
                          capture_output=True, text=True, timeout=120, check=False)
    record.update(exit_code=done.returncode, seconds=round(time.monotonic() - began, 1),
                  output_tail=(done.stdout + done.stderr)[-TAIL_CHARS:])
    if done.returncode == 0:
        stamp.write_text("\n".join(record["wheels"]))
    else:
        record["error"] = f"pip install exited {done.returncode}"
    return record


class Check:
    def __init__(self, out: Outbox, plan: Plan, started: float) -> None:
        self.out, self.plan, self.started = out, plan, started
        self.deadline = started + plan.budget
        self.end = self.deadline - plan.end_margin  # every result written by then
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT / "services"), str(ROOT),
                                                   *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.workdir = ROOT / WORKDIR
        self.workdir.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.time() - self.started

    def say(self, text: str, step: str = "check") -> None:
        line = f"[{self.elapsed():6.1f}s] [{step}] {text.rstrip()}"
        print(line, flush=True)
        self.out.log(line)

    def run_child(self, name: str, cmd: list[str], limit: float) -> tuple[int | str, str, float]:
        """Run `cmd` in a process group of its own for at most `limit` seconds, its output to the console
        and check.log; returns its exit code ("timed out" when the limit stopped it), log tail, seconds."""
        began = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace", process_group=0)
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                self.say(line, name)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        code: int | str
        try:
            code = proc.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            code = "timed out"
            self.stop_group(proc)
        reader.join(timeout=2.0)
        return code, "\n".join(tail)[-TAIL_CHARS:], round(time.monotonic() - began, 1)

    @staticmethod
    def stop_group(proc: subprocess.Popen[str]) -> None:
        for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    # -- the probe ------------------------------------------------------------------------------------------
    def probe(self) -> dict[str, Any]:
        record: dict[str, Any] = {"step": "probe", "status": "running", "stand_in": stand_in(),
                                  "started_unix": round(self.started, 1), "budget_seconds": self.plan.budget,
                                  "command": " ".join(["python3", "-m", "bench.gpu.check", *sys.argv[1:]])
                                  .replace(os.environ.get("OUT") or "\0", "$OUT")}
        record["host"] = host_facts()
        self.say(f"Python {record['host']['python']} on {record['host']['cpus']} CPUs; GPU {record['host']['gpu']}, "
                 f"driver {record['host']['driver']}; make {'present' if record['host']['tools']['make'] else 'absent'}")
        self.out.write("probe.json", record)
        if record["host"]["driver"]:
            self.env[DRIVER_ENV] = record["host"]["driver"]
        record["carry"] = install_carry()
        self.say(f"carried wheels: {len(record['carry']['wheels'])}, "
                 f"{record['carry'].get('error') or 'installed in ' + str(SITE)}")
        self.out.write("probe.json", record)
        problems = [record["carry"]["error"]] if "error" in record["carry"] else []
        if not problems:
            result_path = self.workdir / "probe-imports.json"
            result_path.unlink(missing_ok=True)
            code, tail, seconds = self.run_child(
                "probe", [sys.executable, "-m", "bench.gpu.probe", "--result", str(result_path), "--site", str(SITE)],
                min(self.plan.caps["probe"], self.end - time.time()))
            found = read_json(result_path) or {}
            record.update(found, exit_code=code, seconds=seconds, log_tail=tail)
            problems += found.get("problems") or ([] if code == 0 else [f"the probe exited {code}"])
        record.update(status="failed" if problems else "ok", problems=problems, elapsed=round(self.elapsed(), 1))
        self.out.write("probe.json", record)
        self.say("probe: " + ("ok" if not problems else "FAILED: " + "; ".join(problems)))
        return record

    # -- the steps --------------------------------------------------------------------------------------------
    def step(self, name: str, cmd: list[str], limit: float) -> dict[str, Any]:
        """`cmd` writes its result to $OUT/<name>.json as it goes ("complete": true at its end); this adds the
        status, the seconds and the log tail the moment it ends."""
        path = self.out.path(f"{name}.json")
        started = round(self.elapsed(), 1)
        self.out.write(path.name, {"step": name, "status": "running", "started_s": started})
        self.say(f"== {name} (at most {limit:.0f}s)")
        code, tail, seconds = self.run_child(name, [*cmd, "--result", str(path), "--until", f"{time.time() + limit:.1f}"],
                                             limit)
        result = read_json(path) or {}
        status = ("ok" if code == 0 and result.get("complete") else
                  "timed out" if code == "timed out" else "failed")
        result.update(step=name, status=status, exit_code=code, started_s=started, seconds=seconds, log_tail=tail)
        self.out.write(path.name, result)
        self.say(f"{name}: {status} after {seconds:.0f}s")
        return result

    def skip(self, name: str, why: str) -> None:
        self.out.write(f"{name}.json", {"step": name, "status": "skipped", "why": why})
        self.say(f"{name}: skipped ({why})")

    def run(self) -> int:
        self.say(f"budget {self.plan.budget:.0f}s from the command's start ({self.deadline - time.time():.0f}s left)"
                 + (" on the stand-in box" if stand_in() else ""))
        if self.probe()["status"] != "ok":
            return 3
        statuses = []
        for name in STEPS[:-1]:
            limit = min(self.plan.caps[name], self.end - self.plan.crafter_least - time.time())
            if limit < 5.0:
                self.skip(name, f"{limit:.0f}s left before Crafter's share")
                statuses.append("skipped")
                continue
            statuses.append(self.step(name, [sys.executable, "-m", "bench.gpu.steps", name], limit)["status"])
        stop_at = self.end - self.plan.crafter_stop
        statuses.append(self.step("crafter", [sys.executable, "-m", "bench.gpu.crafter", "--stop-at", f"{stop_at:.1f}"],
                                  self.end - time.time())["status"])
        self.say(f"done: {dict(zip(STEPS, statuses, strict=True))}; every result is in {self.out.dir}")
        return 0 if all(s == "ok" for s in statuses) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="the device tool's $OUT: every result goes there")
    args = p.parse_args(argv)
    return Check(Outbox(args.out), current_plan(), started_at()).run()


if __name__ == "__main__":
    sys.exit(main())
