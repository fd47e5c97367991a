"""The probe's second half, in a child process with the carried wheels on the path: torch, CUDA and
every module the steps import, each with its version and the file it came from.

    python -m bench.gpu.probe --result PATH

A module the carry brings must come from the carried site (a box's older grpcio or protobuf must not
win); Ray and numba are recorded, not needed. Exit status 0 when the steps can run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu.outbox import write_json
from bench.gpu.plan import DRIVER_ENV, stand_in

# Where each module must come from: the box's own packages, the carried wheels, or the checkout.
BOX_MODULES = ("torch", "numpy", "safetensors", "prometheus_client", "PIL", "imageio", "yaml", "cloudpickle",
               "typing_extensions")
CARRIED_MODULES = ("grpc", "grpc_health.v1.health", "google.protobuf", "omegaconf", "antlr4", "gymnasium",
                   "crafter", "opensimplex", "ruamel.yaml", "cryptography.x509")
CHECKOUT_MODULES = ("overworld.v1.trainer_pb2_grpc", "overworld.core.config", "overworld.core.security.tls",
                    "overworld.envs.crafter_task", "overworld.launch.run", "overworld.online",
                    "overworld.rollout_worker.worker", "bench.gpu.vpt_standin", "bench.bench_rollout_worker")
OPTIONAL_MODULES = ("numba", "ray")  # crafter's world generation is faster with numba; Ray is never used


def device_stamp() -> dict[str, Any]:
    """What goes beside every figure: the device, its driver, the torch and the Python that measured it."""
    import torch

    stamp: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                             "python": platform.python_version(), "device": "cpu", "driver": None}
    if torch.cuda.is_available():
        stamp["device"] = torch.cuda.get_device_name(0)
        stamp["driver"] = os.environ.get(DRIVER_ENV)
    return stamp


def import_module(name: str, site: Path | None) -> dict[str, Any]:
    began = time.monotonic()
    try:
        module = importlib.import_module(name)
    except Exception as err:  # any failure to import is what the probe reports
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}
    top = sys.modules[name.split(".")[0]]
    origin = getattr(module, "__file__", None) or getattr(top, "__file__", None)
    out = {"ok": True, "version": getattr(top, "__version__", None), "file": origin,
           "seconds": round(time.monotonic() - began, 2)}
    if site is not None:
        out["from_carry"] = origin is not None and Path(origin).resolve().is_relative_to(site.resolve())
    return out


def import_report(site: Path | None) -> dict[str, dict[str, Any]]:
    """Each module's import; a carried one must come from `site`."""
    report: dict[str, dict[str, Any]] = {}
    for group, names in (("box", BOX_MODULES), ("carried", CARRIED_MODULES), ("checkout", CHECKOUT_MODULES),
                         ("optional", OPTIONAL_MODULES)):
        for name in names:
            row = import_module(name, site if group == "carried" else None)
            row["group"] = group
            if group == "carried" and row["ok"] and not row.get("from_carry"):
                row.update(ok=False, error=f"imported from {row['file']}, not from the carried {site}")
            report[name] = row
            print(f"import {name}: {'ok ' + str(row.get('version') or '') if row['ok'] else row['error']}", flush=True)
    return report


def cuda_facts() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"available": torch.cuda.is_available()}
    if not facts["available"]:
        return facts
    props = torch.cuda.get_device_properties(0)
    facts.update(name=props.name, capability=f"{props.major}.{props.minor}",
                 memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                 bf16=torch.cuda.is_bf16_supported())
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    facts["bf16_matmul_finite"] = bool(torch.isfinite(a @ a).all())  # the kernels exist for this GPU
    return facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--result", required=True, type=Path)
    p.add_argument("--site", type=Path, default=None, help="the carried wheels' site (they must come from it)")
    args = p.parse_args(argv)
    imports = import_report(args.site)
    result: dict[str, Any] = {"imports": imports, "stand_in": stand_in()}
    problems = [f"{name}: {row['error']}" for name, row in imports.items()
                if not row["ok"] and row["group"] != "optional"]
    if imports["torch"]["ok"]:
        result["on"] = device_stamp()
        result["cuda"] = cuda_facts()
        print(f"torch {result['on']['torch']} (CUDA {result['on']['torch_cuda']}) on {result['on']['device']}",
              flush=True)
        if not stand_in() and not result["cuda"]["available"]:
            problems.append("torch sees no CUDA device")
        elif result["cuda"].get("bf16_matmul_finite") is False:
            problems.append("a bf16 matrix product on the GPU was not finite")
    result["problems"] = problems
    write_json(args.result, result)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
