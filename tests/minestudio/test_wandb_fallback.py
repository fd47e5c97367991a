"""logger_config turns W&B on as MineStudio does; with a key but no reachable server (a closed port on
loopback stands for a machine without network), the run is logged offline with one notice."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from overworld.core.config import LoggerConfig
from overworld.trainer.loggers import WandbLogger


@pytest.mark.slow
def test_unreachable_server_logs_offline_with_one_notice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    config = LoggerConfig(project="p", name="n", wandb=True, wandb_init={"settings": {"init_timeout": 10}})
    with caplog.at_level(logging.WARNING, "overworld.trainer"):
        logger = WandbLogger(config, tmp_path, {"seed": 1})
    try:
        assert logger.run.settings.mode == "offline"
        notices = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
        assert len(notices) == 1 and "cannot reach the server" in notices[0] and "wandb sync" in notices[0]
        logger.log({"trainer/policy_loss": 0.1, "trainer/env_steps_all_workers": 10.0}, 1)
    finally:
        logger.close()
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_no_api_key_logs_offline_with_one_notice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with caplog.at_level(logging.WARNING, "overworld.trainer"):
        logger = WandbLogger(LoggerConfig(project="p", name="n", wandb=True), tmp_path, {})
    try:
        assert logger.run.settings.mode == "offline"
        assert [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()][0].startswith("W&B: no API key")
    finally:
        logger.close()
