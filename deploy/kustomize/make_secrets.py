"""Make the Secrets of the kustomize base, which are never committed: the object store's S3 keys,
Redis' password, and a CA of the deployment with a certificate per identity (mutual TLS between the
services, core/security/tls.py). They go to base/secrets/ (git-ignored); `kubectl kustomize` fails until
they exist. Needs the overworld package (`pip install -e .`).

    python deploy/kustomize/make_secrets.py            # once, before the first `kubectl apply -k`
    python deploy/kustomize/make_secrets.py --force    # new ones (a new CA: every pod must restart)
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RELEASE = "overworld"


def make(out: Path, run: str = RELEASE, days: int = 3650) -> None:
    from overworld.core.security import authz, tls

    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name, text in (("s3.env", f"access-key=overworld\nsecret-key={secrets.token_urlsafe(30)}\n"),
                       ("redis.env", f"redis-password={secrets.token_urlsafe(24)}\n")):
        path = out / name
        path.touch(mode=0o600)
        path.write_text(text)
    ca = tls.Authority.create(run, days)
    for identity in authz.IDENTITIES:
        cert, key = ca.issue(identity, run, days, dns_names=(f"{RELEASE}-{identity}",))
        tls.write_identity(out / "tls" / identity, ca.pem, cert, key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "base" / "secrets")
    parser.add_argument("--force", action="store_true", help="replace existing secrets")
    args = parser.parse_args(argv)
    if (args.out / "s3.env").exists() and not args.force:
        print(f"{args.out} exists; --force replaces it (the object store's data then needs the old keys)", file=sys.stderr)
        return 1
    make(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
