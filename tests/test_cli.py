import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from overworld.core.grpc_util import wait_healthy
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_config_error_exits_2_and_names_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train_config:\n  learnin_rate: 0.1\n")
    result = subprocess.run([sys.executable, "-m", "overworld.cli", "run", str(bad)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "train_config.learnin_rate" in result.stderr


def test_serve_answers_health_and_metrics_and_stops_on_sigterm() -> None:
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "OVERWORLD_PORT": str(port), "OVERWORLD_METRICS_PORT": str(metrics_port),
           "OVERWORLD_HOST": "127.0.0.1"}
    proc = subprocess.Popen([sys.executable, "-m", "overworld.cli", "serve", "gae"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"127.0.0.1:{port}", timeout=30, service="overworld.v1.Gae")
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert "overworld_gae_requests_total" in body
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - started < 15
        out = proc.stdout.read() if proc.stdout else ""
        assert "stopped cleanly" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_generated_stubs_match_the_protos(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto/overworld/v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos], check=True, cwd=ROOT)
    generated = sorted(p.name for p in (tmp_path / "overworld/v1").iterdir())
    committed = sorted(p.name for p in (ROOT / "services/overworld/v1").iterdir() if p.suffix in (".py", ".pyi")
                       and p.name != "__init__.py")
    assert generated == committed
    for name in generated:
        assert (tmp_path / "overworld/v1" / name).read_bytes() == (ROOT / "services/overworld/v1" / name).read_bytes(), (
            f"services/overworld/v1/{name} is stale: run `make protos`")
