"""Only the run's own services talk to each other: over real sockets, every service refuses a
plaintext client and a client of another CA, and answers PERMISSION_DENIED (naming the caller and
the method) to every identity on every method core/security/authz.py does not give it."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from overworld.core.grpc_util import channel, health_status, serve, wait_healthy
from overworld.core.security import authz, tls
from overworld.core.security.peers import WrongPeer
from overworld.gae.client import GaeClient
from overworld.gae.server import GaeService
from overworld.v1 import gae_pb2, gae_pb2_grpc
from rehearsal.rpcs import RPCS, call_raw
from tests.security.services_in_one_process import Fleet


def health(ch: grpc.Channel, timeout: float = 5.0) -> grpc.StatusCode:
    try:
        health_status(ch, timeout=timeout)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_every_rpc_is_in_the_table() -> None:
    """A method nobody may call is a method the table forgot (or dead code): each has a caller."""
    for rpc in RPCS:
        assert authz.callers(rpc.path), f"{rpc} is in no identity's row of core/security/authz.py"
    known = {rpc.path for rpc in RPCS} | set(authz.HEALTH) | set(authz.STREAM_METHODS)
    for identity, methods in authz.ALLOWED.items():
        assert set(methods) <= known, f"{identity} lists methods no service has: {set(methods) - known}"


def test_a_plaintext_client_is_refused_by_every_service(fleet: Fleet) -> None:
    for service, address in fleet.addresses.items():
        with grpc.insecure_channel(address) as ch:
            assert health(ch) == grpc.StatusCode.UNAVAILABLE, service
            rpc = next(r for r in RPCS if r.service == service)
            assert call_raw(ch, rpc, [b""], 5)[0] == grpc.StatusCode.UNAVAILABLE, service


def test_a_client_of_another_ca_is_refused_by_every_service(fleet: Fleet, tmp_path: Path) -> None:
    # Same run name, same identity names: only the CA differs.
    other = tls.write_run_credentials(tmp_path, "fleet-run")
    for identity in ("trainer", "operator"):
        tls.use(other[identity])
        for service, address in fleet.addresses.items():
            with channel(address, service) as ch:
                assert health(ch) == grpc.StatusCode.UNAVAILABLE, (identity, service)


def test_each_identity_may_call_exactly_its_methods(fleet: Fleet) -> None:
    assert fleet.credentials is not None
    for identity in authz.IDENTITIES:
        tls.use(fleet.credentials[identity])
        channels = {service: channel(address, service) for service, address in fleet.addresses.items()}
        try:
            for service, ch in channels.items():
                assert health(ch) == grpc.StatusCode.OK, (identity, service)
            for rpc in RPCS:
                # An allowed call gets whatever the service answers to an empty request (or its
                # deadline: Watch and Sample wait for data); a refused one is refused up front.
                code, details = call_raw(channels[rpc.service], rpc, [b""], 1.0)
                if authz.allowed(identity, rpc.path):
                    assert code != grpc.StatusCode.PERMISSION_DENIED, (identity, rpc, details)
                else:
                    assert code == grpc.StatusCode.PERMISSION_DENIED, (identity, rpc, code, details)
                    assert identity in details and rpc.path in details, details
        finally:
            for ch in channels.values():
                ch.close()


def test_a_certificate_of_another_run_from_the_same_issuer_is_refused(tmp_path: Path) -> None:
    """Runs sharing one issuer (a cert-manager ClusterIssuer) stay apart: the run in the SPIFFE ID counts."""
    ca = tls.Authority.create("shared")
    for run, identity in (("run-a", "gae"), ("run-a", "trainer"), ("run-b", "trainer")):
        tls.write_identity(tmp_path / run / identity, ca.pem, *ca.issue(identity, run))
    tls.use(tmp_path / "run-a" / "gae")
    server = serve([(gae_pb2_grpc.add_GaeServicer_to_server, GaeService(), "overworld.v1.Gae")])
    try:
        for run, expected in (("run-a", grpc.StatusCode.INVALID_ARGUMENT), ("run-b", grpc.StatusCode.PERMISSION_DENIED)):
            tls.use(tmp_path / run / "trainer")
            with GaeClient(server.address) as gae:
                with pytest.raises(grpc.RpcError) as err:
                    gae.call("Estimate", gae_pb2.EstimateRequest(), timeout=5)
                assert err.value.code() == expected, err.value.details()
        assert "run 'run-b'" in (err.value.details() or "")
    finally:
        server.stop(0)


def test_a_server_with_a_client_only_certificate_is_not_trusted(fleet: Fleet) -> None:
    """The operator's and run-controller's certificates lack the server name: neither can pose as a service."""
    assert fleet.credentials is not None
    tls.use(fleet.credentials["operator"])
    impostor = serve([(gae_pb2_grpc.add_GaeServicer_to_server, GaeService(), "overworld.v1.Gae")])
    try:
        tls.use(fleet.credentials["trainer"])
        with channel(impostor.address, "gae") as ch:
            assert health(ch, 3) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        impostor.stop(0)


CLIENTS = {"rollout-manager": "overworld.rollout_manager.client:RolloutManagerClient",
           "replay-buffer": "overworld.replay_buffer.client:ReplayBufferClient",
           "gae": "overworld.gae.client:GaeClient",
           "model-registry": "overworld.model_registry.client:ModelRegistryClient",
           "trainer": "overworld.trainer.client:TrainerClient",
           "rollout-worker": "overworld.rollout_worker.client:RolloutWorkerClient"}


@pytest.fixture(scope="module")
def impostors(fleet: Fleet) -> dict[str, str]:
    """A server of each serving identity of the run, holding its genuine certificate (a pod of the run that
    was compromised, or an address that points at the wrong pod): identity -> address."""
    assert fleet.credentials is not None
    servers = {}
    for identity in authz.SERVING:
        tls.use(fleet.credentials[identity])
        servers[identity] = serve([(gae_pb2_grpc.add_GaeServicer_to_server, GaeService(), "overworld.v1.Gae")])
    tls.reset()
    yield {identity: server.address for identity, server in servers.items()}
    for server in servers.values():
        server.stop(0)


@pytest.mark.parametrize("meant", sorted(CLIENTS))
def test_every_client_refuses_a_server_of_another_identity(fleet: Fleet, impostors: dict[str, str], meant: str) -> None:
    """A certificate of the run is not enough: each client talks only to the identity it meant to reach
    (a rollout worker runs game code and must not pass as the registry). The refusal names both."""
    from google.protobuf import message_factory

    from overworld.core.imports import import_object

    assert fleet.credentials is not None
    client_class = import_object(CLIENTS[meant])
    rpc = next(r for r in RPCS if r.service == meant and not r.client_streaming and not r.server_streaming)
    request = message_factory.GetMessageClass(rpc.request_type)()  # it never arrives: anything goes
    tls.use(fleet.credentials["operator"])
    try:
        for posing, address in impostors.items():
            with client_class(address) as client, pytest.raises(grpc.RpcError) as err:
                client.call(rpc.name, request, timeout=5)
            if posing == meant:  # the identity meant: the handshake passes (the stand-in serves only Gae)
                assert not isinstance(err.value, WrongPeer), err.value
                continue
            assert isinstance(err.value, WrongPeer), (meant, posing, err.value)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            details = err.value.details()
            assert f"presented {posing}'s certificate of run fleet-run, not the {meant}" in details, details
    finally:
        tls.reset()


def test_the_health_port_answers_kubelet_probes_and_nothing_else(fleet: Fleet, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    from tests.support import free_port

    assert fleet.credentials is not None
    port = free_port()
    monkeypatch.setenv("OVERWORLD_HEALTH_PORT", str(port))
    tls.use(fleet.credentials["gae"])
    server = serve([(gae_pb2_grpc.add_GaeServicer_to_server, GaeService(), "overworld.v1.Gae")])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # as kubelet: plaintext, no certificate
            assert health(ch) == grpc.StatusCode.OK
            assert health_status(ch, "overworld.v1.Gae", timeout=5) == health_pb2.HealthCheckResponse.SERVING
            estimate = next(r for r in RPCS if r.path.endswith("Gae/Estimate"))
            assert call_raw(ch, estimate, [b""], 5)[0] == grpc.StatusCode.UNIMPLEMENTED
            server.set_serving(False)
            assert health_status(ch, timeout=5) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(0)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        assert health(ch, 2) == grpc.StatusCode.UNAVAILABLE  # stopped with its server


def test_certificates_rotate_without_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """New files (here even a new CA) are used by the running server's next handshake and by an open
    channel's next connection; a client still holding the old files is then refused."""
    monkeypatch.setattr(tls, "RELOAD_CHECK_SECONDS", 0.0)
    first = tls.write_run_credentials(tmp_path / "first", "run")
    second = tls.write_run_credentials(tmp_path / "second", "run")
    live = {i: tmp_path / "live" / i for i in ("gae", "trainer")}
    for identity, path in live.items():
        shutil.copytree(first[identity], path)
    tls.use(live["gae"])
    server = serve([(gae_pb2_grpc.add_GaeServicer_to_server, GaeService(), "overworld.v1.Gae")])
    tls.use(live["trainer"])
    gae = GaeClient(server.address)
    try:
        wait_healthy(server.address, 10, peer="gae")
        with pytest.raises(grpc.RpcError) as err:
            gae.call("Estimate", gae_pb2.EstimateRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # through TLS and authorization
        for identity, path in live.items():  # as a Secret volume update: every file replaced
            for name in (tls.CERT, tls.KEY, tls.CA):
                shutil.copy(second[identity] / name, path / f".{name}")
                (path / f".{name}").replace(path / name)
        old = tmp_path / "old"
        shutil.copytree(first["trainer"], old)
        tls.use(old)
        with channel(server.address, "gae") as stale:
            assert health(stale, 3) == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:  # the open channel follows its files
            gae.call("Estimate", gae_pb2.EstimateRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        gae.close()
        server.stop(0)


def test_the_run_controller_reads_trainer_progress_over_mutual_tls(fleet: Fleet, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    from overworld.run_controller.progress import read_progress

    assert fleet.credentials is not None
    monkeypatch.setenv(tls.TLS_DIR_ENV, str(fleet.credentials["run-controller"]))
    progress = asyncio.run(read_progress(fleet.addresses["trainer"]))
    assert progress.model_version == 0  # an answer, through TLS and authorization
    monkeypatch.delenv(tls.TLS_DIR_ENV)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(read_progress(fleet.addresses["trainer"], timeout=3))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_documented_table_is_the_code() -> None:
    """docs/operations.md's "Who may call what" is core/security/authz.py's table."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    documented = {}
    for line in text.split("### Who may call what", 1)[1].split("###", 1)[0].splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and "/" in cells[0]:
            documented[f"/overworld.v1.{cells[0]}"] = [c.strip() for c in cells[1].split(",")]
    assert documented == {path: authz.callers(path) for path in [*(rpc.path for rpc in RPCS), *authz.STREAM_METHODS]}


def test_unreadable_credentials_say_which_file_and_why(tmp_path: Path) -> None:
    """A Secret mounted 0440 without the pod's fsGroup: the files are there but this user cannot read
    them. The error names the file, the user and the file's owner and mode, not "incomplete"."""
    import os
    import tempfile

    base = Path(tempfile.mkdtemp(dir="/var/tmp"))  # pytest's tmp_path is root's only: not searchable by 10001
    base.chmod(0o755)
    identity = tls.write_run_credentials(base / "run", "overworld")["gae"]
    (base / "run").chmod(0o755)
    for path in [identity, *identity.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o440)  # root's, as the kubelet mounts a Secret without fsGroup
    # A fork that becomes uid 10001 with the code this process has loaded: a new interpreter as 10001
    # could not import overworld from a clone under a directory only root may enter (mktemp -d).
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.setgroups([])
            os.setgid(10001)
            os.setuid(10001)
            try:
                tls.CredentialFiles(identity)
                message = "read them"
            except Exception as err:
                message = f"{type(err).__name__}: {err}"
            os.write(write, message.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(child, 0)
    assert message.startswith("PermissionError"), message
    assert f"cannot read {identity / tls.CERT}" in message and "uid 10001" in message, message
    assert "fsGroup" in message, message
    (identity / tls.KEY).unlink()
    with pytest.raises(FileNotFoundError, match=f"{identity / tls.KEY} is missing"):
        tls.CredentialFiles(identity)
    shutil.rmtree(base)
