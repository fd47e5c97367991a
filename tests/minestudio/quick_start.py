"""A MineStudio-style quick start file (online_dict + argument-less generators) run through a real
rollout worker against real manager, buffer and registry servers."""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

from overworld.core.wire.fragment import Fragment, validate

HERE = Path(__file__).resolve().parent

def run_quick_start(make_cluster_from_file, tmp_path: Path, policy: str, module: str = "minecraft_sim_standin") -> None:  # type: ignore[no-untyped-def]
    """A MineStudio-style file (online_dict + generators) through a real worker, env processes included."""
    quick_start = tmp_path / "quick_start.py"
    quick_start.write_text(textwrap.dedent(QUICK_START).replace("{HERE}", repr(str(HERE))).replace("{POLICY}", policy).replace("{MODULE}", module))
    _run(make_cluster_from_file, quick_start)


QUICK_START = """
        import importlib.util


        def _load(name):
            spec = importlib.util.spec_from_file_location(name, {HERE} + "/" + name + ".py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module

        online_dict = {
            "run_id": "wtest",
            "rollout_config": {"fragment_length": 16, "to_send_queue_size": 8,
                               "worker_config": {"num_envs": 4, "batch_size": 2, "num_env_processes": 2,
                                                 "device": "auto"},
                               "replay_buffer_config": {"max_chunks": 1000, "max_reuse": 1, "max_staleness": 100}},
            "train_config": {"batches_per_iteration": 1, "gradient_accumulation": 1, "context_length": 16,
                             "use_normalized_vf": True},
        }

        def env_generator():
            return _load("minecraft_sim_standin").env_generator()


        def policy_generator():
            return _load("{MODULE}").{POLICY}()
"""


def _run(make_cluster_from_file, quick_start: Path) -> None:  # type: ignore[no-untyped-def]
    from overworld.rollout_worker.worker import RolloutWorker

    cluster = make_cluster_from_file(quick_start)
    worker = RolloutWorker(*cluster.addresses)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while worker.sender.sent < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        worker.stop_event.set()
        thread.join(30)
        worker.shutdown()
    assert worker.sender.sent >= 8 and cluster.manager._episodes > 0
    stats = cluster.stats()
    chunks = cluster.take(stats.chunks)
    for chunk in chunks:
        fragment = Fragment.from_proto(chunk.fragments[0])
        validate(fragment, cluster.spaces, 16, "wtest")
        assert fragment.data["action.buttons"].max() < 8641 and fragment.data["action.camera"].max() < 121
        assert any(k.startswith("state.") for k in fragment.data)  # VPT's transformer memory travels along
