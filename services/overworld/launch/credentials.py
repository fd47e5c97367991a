"""A run's credentials on one machine: a throwaway CA and a certificate per identity
(<workdir>/tls/<identity>/), and the token of the trainer's local Ray."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from overworld.core.security import authz, tls


@dataclass
class RunSecurity:
    """Made at every start (a resumed run's old services are gone); the CA's key is never written."""

    identities: dict[str, Path]
    ray_token: Path

    @classmethod
    def load(cls, workdir: Path) -> RunSecurity | None:
        """The credentials a launcher made earlier in `workdir` (the rollout side's, for the trainer that
        start_trainer adds to it); None when that launcher ran --insecure."""
        root = workdir / "tls"
        if not (root / "operator" / tls.CERT).exists():
            return None
        return cls({i: root / i for i in authz.IDENTITIES}, root / "ray-auth-token")

    @classmethod
    def create(cls, workdir: Path, run_id: str) -> RunSecurity:
        root = workdir / "tls"
        identities = tls.write_run_credentials(root, run_id)
        token = root / "ray-auth-token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        return cls(identities, token)

    def env(self, service: str) -> dict[str, str]:
        """The environment that gives `service` its identity."""
        out = {tls.TLS_DIR_ENV: str(self.identities[service])}
        if service == "trainer":  # the trainer's local Ray: token authentication with this run's token
            out.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.ray_token))
        return out
