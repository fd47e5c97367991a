"""Run inside a venv of the services role alone (tests/test_dependency_roles.py): torch, Ray and W&B
are not there; every service of the services image builds its parser, and the rollout-manager,
replay-buffer, gae and model-registry start, answer their health checks and work together; the
registry casts a version to bfloat16 for a watcher. Prints a JSON report on stdout.

    PYTHONPATH=services python tests/services_role_probe.py WORKDIR
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_SERVICES = ("rollout-manager", "replay-buffer", "gae", "model-registry", "run-controller")
ABSENT = ("torch", "ray", "wandb")


def main() -> int:
    import numpy as np
    from safetensors.numpy import save

    from overworld import serve
    from overworld.core.grpc_util import wait_healthy
    from overworld.model_registry.client import ModelRegistryClient
    from overworld.rollout_manager.client import RolloutManagerClient

    workdir = Path(sys.argv[1])
    report: dict[str, object] = {"importable": [m for m in ABSENT if importlib.util.find_spec(m) is not None]}
    report["help"] = {name: serve.parser(name).format_help().count("--") for name in IMAGE_SERVICES}
    import overworld.run_controller.handlers  # noqa: F401 - the operator's code, kopf included
    import overworld.run_controller.operator  # noqa: F401

    common = ["--host", "127.0.0.1", "--port", "0", "--insecure", "--workdir", str(workdir)]
    flags = {"rollout-manager": ["--config", str(ROOT / "examples" / "cartpole.yaml"), "--index", "memory",
                                 "--fresh-state"],
             "model-registry": ["--blobs", str(workdir / "registry")], "gae": []}
    done = threading.Event()
    handles, addresses = [], {}
    try:
        for name in ("rollout-manager", "model-registry", "gae", "replay-buffer"):
            own = flags.get(name, ["--rollout-manager", addresses.get("rollout-manager", ""), "--index", "memory"])
            args = serve.parse(name, [*common, *own])
            serve.use_tls_flags(args, log=False)
            handle = serve.BUILDERS[name](args, done)
            handles.append(handle)
            addresses[name] = handle.server.address
            wait_healthy(addresses[name], timeout=30, peer=name)
        report["run_id"] = RolloutManagerClient(addresses["rollout-manager"]).run_config().run_id
        data = save({"w": np.linspace(-3, 3, 1000, dtype=np.float32), "steps": np.arange(4, dtype=np.int64)})
        registry = ModelRegistryClient(addresses["model-registry"])
        registry.publish(1, data)
        info, half = registry.fetch(precision="bfloat16")
        registry.close()
        report.update(published=data.hex(), bfloat16=half.hex(), dtype=info.dtype,
                      sha256_matches=info.sha256 == hashlib.sha256(half).hexdigest())
    finally:
        for handle in reversed(handles):
            handle.stop(0)
    report["imported"] = [m for m in ABSENT if m in sys.modules]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
