"""Every malformed safetensors payload of tests/core/safetensors_cases.py, published and then fetched
in half precision, is refused as FAILED_PRECONDITION (the registry cannot cast what it cannot read);
its stored bytes are still served as they are, and the registry goes on serving."""

from __future__ import annotations

from pathlib import Path

import grpc
import torch

from overworld.core.blobs.store import LocalBlobStore
from overworld.core.grpc_util import serve, wait_healthy
from overworld.core.wire import weights
from overworld.model_registry.client import ModelRegistryClient
from overworld.model_registry.server import ModelRegistryService, registration
from tests.core.safetensors_cases import CASES


def test_malformed_payloads_are_not_cast(tmp_path: Path) -> None:
    service = ModelRegistryService(LocalBlobStore(tmp_path / "blobs"), chunk_size=1 << 16)
    server = serve([registration(service)])
    client = ModelRegistryClient(server.address)
    try:
        wait_healthy(server.address)
        good = weights.to_bytes({"w": torch.arange(12.0).reshape(3, 4), "steps": torch.tensor([3, 4])})
        wrong = []
        for version, (case, make) in enumerate(CASES.items(), start=1):
            bad = make(good)
            client.publish(version, bad)
            try:
                client.fetch(version, precision="bfloat16", timeout=30)
                wrong.append(f"{case}: cast")
            except grpc.RpcError as err:
                if (err.code() != grpc.StatusCode.FAILED_PRECONDITION
                        or f"cannot send version {version} as bfloat16" not in (err.details() or "")):
                    wrong.append(f"{case}: {err.code()} {err.details()}")
            assert client.fetch(version, timeout=30)[1] == bad, case
        assert not wrong, "\n".join(wrong)
        last = len(CASES) + 1
        client.publish(last, good)
        assert client.fetch(last, precision="bfloat16", timeout=30)[0].dtype == "bfloat16"
    finally:
        client.close()
        service.stop()
        server.stop(0)
