"""A stop with a deadline (the trainer pod's grace period): an update that would outlast it is cut short
between optimizer steps, so that the checkpoint is written before the kubelet's SIGKILL. Unit tests on
the learner; real `overworld run`s whose trainer is stopped in the middle of a long update, by its
SIGTERM or by a Ray worker pod's preStop (a node of the trainer's going)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from overworld.core.grpc_util import Server, serve
from overworld.run_controller import ray_prestop
from overworld.trainer.checkpoint import iteration_of
from overworld.trainer.client import TrainerClient
from overworld.trainer.driver import EXIT_SECONDS, TrainerStatusService
from overworld.trainer.stopping import STOP_MARGIN_SECONDS
from overworld.v1 import trainer_pb2_grpc
from tests.support import interrupt_run
from tests.trainer.helpers import flat_params, make_batch, make_trainer

ROOT = Path(__file__).resolve().parents[2]


def test_no_deadline_trains_every_step() -> None:
    trainer = make_trainer("train_config.epochs_per_iteration=6")
    metrics = trainer.train_iteration(make_batch(trainer, 8, 32))
    assert trainer.updates == 6 and not trainer.cut_short
    assert metrics is not None and metrics["trainer/update_cut_short"] == 0.0


def test_a_deadline_too_close_for_the_checkpoint_takes_no_step() -> None:
    trainer = make_trainer("train_config.epochs_per_iteration=6")
    before = flat_params(trainer.model)
    trainer.stop_deadline.checkpoint_seconds = 1.0
    trainer.stop_deadline.at = time.monotonic() + STOP_MARGIN_SECONDS + 0.5  # not even the checkpoint fits
    metrics = trainer.train_iteration(make_batch(trainer, 8, 32))
    assert trainer.updates == 0 and trainer.cut_short
    assert metrics is not None and metrics["trainer/update_cut_short"] == 1.0
    assert (flat_params(trainer.model) == before).all()


def test_the_update_stops_where_one_more_step_would_miss_the_deadline() -> None:
    trainer = make_trainer("train_config.epochs_per_iteration=100000")
    trainer.stop_deadline.checkpoint_seconds = 0.5
    trainer.stop_deadline.at = time.monotonic() + STOP_MARGIN_SECONDS + 2.5
    trainer.train_iteration(make_batch(trainer, 8, 32))
    late = time.monotonic() - trainer.stop_deadline.at
    assert trainer.cut_short and 0 < trainer.updates < 100000
    # what is left before the deadline holds the checkpoint and the margin
    assert late <= -(0.5 + STOP_MARGIN_SECONDS) + 0.2, late


def seconds_of(line: str) -> float:
    stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
    assert stamp, line
    return time.mktime(time.strptime(stamp.group(1)[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp.group(1)[20:]) / 1000


@pytest.mark.slow
def test_a_trainer_stopped_mid_update_checkpoints_within_its_grace(tmp_path: Path) -> None:
    # one iteration's update takes about a minute (30,000 epochs); the trainer's grace period is 12 s
    grace = 12
    workdir = tmp_path / "run"
    text = interrupt_run(ROOT / "examples" / "cartpole.yaml", workdir, "first batch in: updating",
                         "--set", "train_config.epochs_per_iteration=30000", then_wait=3,
                         env={"OVERWORLD_STOP_GRACE_SECONDS": str(grace)})
    assert "update of iteration 1 cut short" in text, text[-3000:]
    lines = text.splitlines()
    signalled = next(seconds_of(line) for line in lines if "received SIGTERM" in line)
    stopped = next(seconds_of(line) for line in lines if "stopped cleanly" in line)
    # without the deadline read, the stop waits for the rest of the update (minutes)
    assert stopped - signalled <= grace, text[-3000:]
    # the iteration cut short is the one checkpointed
    assert [p for p in workdir.rglob("iter-*") if iteration_of(p.name.split(".")[0]) == 1], sorted(workdir.rglob("*"))


# --- a node of the trainer's going: a Ray worker pod's preStop asks the driver ---------------------------


@pytest.fixture
def driver_status() -> Iterator[tuple[TrainerStatusService, Server]]:
    service = TrainerStatusService()
    server = serve([(trainer_pb2_grpc.add_TrainerServicer_to_server, service, "overworld.v1.Trainer")])
    yield service, server
    server.stop(0)


def test_a_stop_request_sets_the_deadline_the_ranks_read(driver_status: tuple[TrainerStatusService, Server]) -> None:
    service, server = driver_status
    with TrainerClient(server.address) as trainer:
        answer = trainer.request_stop(40.0, "node n-1 is going")
    assert answer.stop_requested and 40.0 - EXIT_SECONDS - 1 < answer.stop_seconds_left <= 40.0 - EXIT_SECONDS
    assert service.node_going == "node n-1 is going"


@pytest.mark.parametrize("seconds, reason", [(0.0, ""), (-1.0, ""), (float("nan"), ""), (float("inf"), ""),
                                             (3601.0, ""), (10.0, "x" * 201)])
def test_a_malformed_stop_request_is_refused_and_stops_nothing(
        driver_status: tuple[TrainerStatusService, Server], seconds: float, reason: str) -> None:
    service, server = driver_status
    with TrainerClient(server.address) as trainer, pytest.raises(grpc.RpcError) as err:
        trainer.request_stop(seconds, reason)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "seconds_left" in (err.value.details() or "")
    assert not service.stop_requested.is_set() and service.stop_deadline is None


def test_the_prestop_of_a_finished_trainer_asks_nothing(driver_status: tuple[TrainerStatusService, Server],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    service, server = driver_status
    service.set_state("finished")
    host, port = server.address.rsplit(":", 1)
    monkeypatch.setenv("FQ_RAY_IP", host)
    assert ray_prestop.main(["--trainer-port", port, "--timeout", "5"]) == 0
    assert not service.stop_requested.is_set()


@pytest.mark.slow
def test_a_ray_worker_going_checkpoints_and_the_next_attempt_resumes_from_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `overworld run` restarts a trainer that failed, as KubeRay retries an attempt; the Ray worker pod's
    # preStop is the one the controller renders (--trainer-port), its grace 15 s
    workdir = tmp_path / "run"
    code: list[int] = []

    def preempt_a_ray_worker() -> None:
        host, port = json.loads((workdir / "services.json").read_text())["services"]["trainer"]["address"].rsplit(":", 1)
        monkeypatch.setenv("FQ_RAY_IP", host)
        started = time.monotonic()
        code.append(ray_prestop.main(["--trainer-port", port, "--timeout", "15"]))
        code.append(int(time.monotonic() - started))

    text = interrupt_run(ROOT / "examples" / "cartpole.yaml", workdir, "first batch in: updating",
                         "--set", "train_config.epochs_per_iteration=30000", act=preempt_a_ray_worker,
                         until="resumed from iter-00000001")
    assert code[0] == 0 and code[1] <= 15, code  # the trainer had ended within the grace
    assert "update of iteration 1 cut short" in text, text[-3000:]
    assert "stopped because Ray worker pod" in text and "checkpointed iter-00000001" in text, text[-3000:]
