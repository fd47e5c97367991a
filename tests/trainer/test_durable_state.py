"""Training state that no pod can lose: with save_path in the object store (a real S3-protocol
server), a trainer in a fresh pod (an empty workdir) resumes from the checkpoint another pod wrote,
and the TensorBoard / W&B files are copied next to the checkpoints."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import torch

from overworld.core.blobs.urls import open_blob_store
from overworld.core.config import load_config
from overworld.trainer.builtin_hooks import LogMetrics
from overworld.trainer.checkpoint import checkpoint_store, is_durable
from overworld.trainer.driver import apply_flags
from tests.support import S3Server
from tests.trainer.helpers import ROOT, flat_params, make_batch, make_trainer

BASE = ["train_config.epochs_per_iteration=1", "train_config.batches_per_iteration=2",
        "train_config.batch_size_per_gpu=4", "train_config.context_length=8", "train_config.kl_divergence_coef_rho=0.1"]


def on_disk(workdir: Path) -> list[Path]:
    return [p for p in workdir.rglob("*") if p.is_file()] if workdir.exists() else []


def test_a_fresh_pod_resumes_from_the_checkpoint_another_pod_wrote(s3_env, tmp_path: Path) -> None:
    save = f"s3://overworld-trainer-test/{uuid.uuid4().hex[:8]}"
    overrides = [*BASE, f"train_config.save_path={save}", "run_id=durable"]
    pod_a = make_trainer(*overrides)
    pod_a.workdir = str(tmp_path / "pod-a")
    pod_a.checkpoints = checkpoint_store(pod_a.config, pod_a.workdir)
    pod_a.iteration = 1
    pod_a.train_iteration(make_batch(pod_a, B=8, L=16))
    pod_a.iteration, pod_a.model_version, pod_a.env_steps, pod_a.rho = 10, 7, 5120, 0.0437
    assert pod_a.save_checkpoint() == "iter-00000010"
    rng = torch.get_rng_state()
    assert on_disk(tmp_path / "pod-a") == []  # nothing on the pod's own disk

    torch.manual_seed(12345)  # another process, started as `kubectl patch ... resumeFrom: latest` starts it
    pod_b = make_trainer(*overrides, "train_config.resume=latest")
    pod_b.workdir = str(tmp_path / "pod-b")  # empty: a new pod
    pod_b.checkpoints = checkpoint_store(pod_b.config, pod_b.workdir)
    assert not torch.equal(flat_params(pod_b.unwrapped_model), flat_params(pod_a.unwrapped_model))
    pod_b.restore()
    assert pod_b.resumed_from == "iter-00000010"
    assert (pod_b.iteration, pod_b.updates, pod_b.model_version, pod_b.env_steps) == (10, 2, 7, 5120)
    assert pod_b.rho == 0.0437
    torch.testing.assert_close(flat_params(pod_b.unwrapped_model), flat_params(pod_a.unwrapped_model), rtol=0, atol=0)
    assert pod_b.reference is not None and pod_a.reference is not None
    torch.testing.assert_close(flat_params(pod_b.reference), flat_params(pod_a.reference), rtol=0, atol=0)
    a_opt, b_opt = pod_a.optimizer.state_dict()["state"], pod_b.optimizer.state_dict()["state"]
    assert a_opt.keys() == b_opt.keys() and all(torch.equal(a_opt[k]["exp_avg"], b_opt[k]["exp_avg"]) for k in a_opt)
    assert torch.equal(torch.get_rng_state(), rng)
    assert on_disk(tmp_path / "pod-b") == []


def test_tensorboard_and_wandb_files_reach_the_save_path(s3_env, tmp_path: Path) -> None:
    save = f"s3://overworld-trainer-test/{uuid.uuid4().hex[:8]}"
    trainer = make_trainer(f"train_config.save_path={save}", "run_id=run-7", "logger_config.tensorboard=true",
                           "logger_config.wandb=true", "logger_config.console=false")
    trainer.config.logger_config.wandb_init = {"mode": "offline"}
    trainer.workdir = str(tmp_path / "pod")
    logger = LogMetrics(trainer)
    assert logger.sync is not None
    for iteration in (1, 2):
        trainer.iteration = iteration
        logger(trainer, {"trainer/total_loss": 1.0 / iteration})
    logger.close()  # the end of training: everything is copied
    store = open_blob_store(save)
    local = {p.relative_to(tmp_path / "pod" / "logs" / "run-7").as_posix(): p for p in on_disk(tmp_path / "pod" / "logs")}
    remote = set(store.keys("run-7/logs/"))
    assert any(k.startswith("tensorboard/events.out.tfevents") for k in local)
    assert any(k.startswith("wandb/") for k in local)
    assert remote == {f"run-7/logs/{k}" for k in local}
    for key, path in local.items():
        assert store.get(f"run-7/logs/{key}") == path.read_bytes()


def test_the_deployments_save_path_wins_and_local_runs_keep_the_workdir() -> None:
    config = load_config(ROOT / "examples/cartpole.yaml")
    assert config.train_config.save_path == "output" and not is_durable(config)
    apply_flags(config, "", "s3://bucket/runs")
    assert config.train_config.save_path == "s3://bucket/runs" and is_durable(config)


def test_a_checkpoint_waits_out_an_object_store_that_restarts(tmp_path: Path, monkeypatch) -> None:
    """The object store's pod deleted while a checkpoint is written: nothing answers on its address for a
    few seconds, then a new server does (its volume still holds the bucket). The checkpoint is written
    once it is back, instead of the trainer failing (and its attempt with it)."""
    server = S3Server()
    server.start()
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    save = "s3://overworld-trainer-test/restarting"
    trainer = make_trainer(*BASE, f"train_config.save_path={save}", "run_id=restarting")
    trainer.checkpoints = checkpoint_store(trainer.config, str(tmp_path))  # creates the bucket
    trainer.iteration = 3
    server.stop()  # the pod is gone: connections refused

    def back_in(seconds: float) -> None:
        time.sleep(seconds)
        server.start()  # the same address
        open_blob_store(save)  # what the object store's volume keeps: the bucket

    threading.Thread(target=back_in, args=(12.0,), daemon=True).start()  # longer than the S3 client's own retries
    try:
        started = time.monotonic()
        assert trainer.save_checkpoint() == "iter-00000003"
        assert time.monotonic() - started > 11.0
        assert checkpoint_store(trainer.config, str(tmp_path)).list() == ["iter-00000003"]
    finally:
        server.stop()
