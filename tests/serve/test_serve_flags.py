"""`overworld serve SERVICE` and `python -m overworld.SERVICE` are one parser per service
(overworld/serve/<service>.py): the same flags, each listed by --help, defaults from the
environment; only the local defaults of `python -m` (loopback, no metrics port) differ."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from overworld import cli, serve

ROOT = Path(__file__).resolve().parents[2]


def options(help_text: str) -> set[str]:
    """The flags of a --help's options list."""
    return set(re.findall(r"^  (--[a-z][a-z-]*)", help_text, flags=re.M)) - {"--help"}


def serve_help(service: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", service, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("service", list(serve.MODULES))
def test_serve_and_python_m_list_the_same_flags(service: str, capsys: pytest.CaptureFixture[str]) -> None:
    served = serve_help(service, capsys)
    package = serve.MODULES[service].rsplit(".", 1)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERWORLD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services"), env.get("PYTHONPATH", "")])
    python_m = subprocess.run([sys.executable, "-m", f"overworld.{package}", "--help"], capture_output=True,
                              text=True, timeout=60, env=env)
    assert python_m.returncode == 0, python_m.stderr
    assert python_m.stdout.startswith(f"usage: python -m overworld.{package}")
    assert options(served) == options(python_m.stdout) and options(served)


def test_each_service_lists_only_its_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    registry = options(serve_help("model-registry", capsys))
    assert {"--registry-chunk-bytes", "--registry-relay-fanout", "--retain", "--blobs", "--tls-dir"} <= registry
    assert not registry & {"--index", "--config", "--ray-address", "--flush-timeout", "--rollout-manager"}
    gae = options(serve_help("gae", capsys))
    assert gae == {"--host", "--port", "--metrics-port", "--tls-dir", "--insecure"}
    with pytest.raises(SystemExit) as exited:
        serve.parse("model-registry", ["--index", "redis://r:6379/0"])
    assert exited.value.code == 2


def test_the_registry_served_reads_its_push_tuning_from_the_environment() -> None:
    with mock.patch.dict(os.environ, {"OVERWORLD_REGISTRY_CHUNK_BYTES": "123",
                                      "OVERWORLD_REGISTRY_RELAY_FANOUT": "0"}):
        args = cli.serve_args(["model-registry"])
    assert args.registry_chunk_bytes == 123 and args.registry_relay_fanout == 0
    assert cli.serve_args(["model-registry", "--registry-max-rpcs", "9"]).registry_max_rpcs == 9


def test_python_m_defaults_to_loopback_without_metrics_unless_told() -> None:
    with mock.patch.dict(os.environ, {}, clear=False):
        for name in ("OVERWORLD_HOST", "OVERWORLD_METRICS_PORT"):
            os.environ.pop(name, None)
        served, local = serve.parse("gae", []), serve.parse("gae", [], local=True)
        assert (served.host, served.metrics_port, served.port) == ("0.0.0.0", 9090, 50053)
        assert (local.host, local.metrics_port, local.port) == ("127.0.0.1", 0, 50053)
        os.environ["OVERWORLD_METRICS_PORT"] = "9100"
        assert serve.parse("gae", [], local=True).metrics_port == 9100


def test_overworld_run_may_give_every_service_a_workdir() -> None:
    """`overworld run` (launch/supervisor.py) passes --workdir to all: the services that keep nothing on disk accept it unlisted."""
    for service in serve.BUILDERS:
        assert serve.parse(service, ["--workdir", "/tmp/x"]).workdir == "/tmp/x"
