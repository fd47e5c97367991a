"""Mutual TLS for every gRPC server and client: a run's CA and per-identity certificates, this
process's credentials, and reloading them when their files change (rotation without a restart).

One identity's credentials are a directory in the layout of a Kubernetes TLS Secret (and of a
cert-manager Certificate's Secret): ``tls.crt``, ``tls.key``, ``ca.crt``. A process has one identity:
``$OVERWORLD_TLS_DIR`` (``--tls-dir``), or the one `use()` set. Without either, servers and channels
are plaintext (``overworld serve`` says so in its log; ``overworld run`` and the chart always set one
unless told ``--insecure`` / ``tls.enabled=false``).

Servers ask for a client certificate of the CA and re-read their files on the next handshake after a
change (gRPC's certificate-configuration fetcher). Clients check the server's certificate against the
CA and against the name of the identity they meant to reach, `server_name(identity)`
("model-registry.overworld.internal"), which only that identity's certificates carry: service
addresses are pod IPs and per-attempt Ray head names, so no real hostname could be pinned, and a
certificate of the run is not enough (a rollout worker runs game code and must not pass as the
registry). A peer that presents another identity's certificate is refused with `WrongPeer` (peers.py),
which names both. A channel whose files changed opens its next connections with the new files.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from overworld.core.security import authz
from overworld.core.security.peers import WrongPeer, presented_identity

SERVER_DOMAIN = "overworld.internal"
CERT, KEY, CA = "tls.crt", "tls.key", "ca.crt"
TLS_DIR_ENV = "OVERWORLD_TLS_DIR"
RELOAD_CHECK_SECONDS = 5.0  # how often a client channel looks at its files


def server_name(identity: str) -> str:
    """The name a client checks a server's certificate for when it means to reach `identity`."""
    return f"{identity}.{SERVER_DOMAIN}"


# -- issuing (overworld run, `overworld certs`, tests) --------------------------------------------------

def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem(obj: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    if hasattr(obj, "private_bytes"):
        return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    return obj.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Authority:
    """A CA: its certificate and key (the key stays in memory; `overworld run` never writes it)."""
    cert: Any
    key: Any

    @property
    def pem(self) -> bytes:
        return _pem(self.cert)

    @classmethod
    def create(cls, name: str, days: int = 365) -> Authority:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import NameOID

        key = _new_key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"overworld CA {name}"[:64])])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             key_cert_sign=True, crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(cert, key)

    def issue(self, identity: str, run: str, days: int = 365, dns_names: Sequence[str] = ()) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) for `identity` of `run`: CN and SAN URI name it; serving
        identities also carry their server name, `server_name(identity)` (and `dns_names`)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = _new_key()
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(authz.spiffe_id(run, identity))]
        if identity in authz.SERVING:
            names += [x509.DNSName(n) for n in (server_name(identity), *dns_names)]
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        return _pem(cert), _pem(key)


def write_identity(directory: Path, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> Path:
    """Write one identity's files (key readable by its owner only), replacing each atomically."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name, data, mode in ((KEY, key_pem, 0o600), (CERT, cert_pem, 0o644), (CA, ca_pem, 0o644)):
        tmp = directory / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, directory / name)
    return directory


def write_run_credentials(root: Path, run: str, identities: Sequence[str] = authz.IDENTITIES,
                          days: int = 365) -> dict[str, Path]:
    """A throwaway CA for `run` and a certificate for each identity: root/<identity>/{tls.crt,tls.key,ca.crt}.
    The CA's key is not written: nothing can be issued for this run afterwards."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca = Authority.create(run, days)
    out = {}
    for identity in identities:
        cert, key = ca.issue(identity, run, days, dns_names=("localhost",))
        out[identity] = write_identity(root / identity, ca.pem, cert, key)
    return out


# -- this process's credentials ------------------------------------------------------------------------

class CredentialFiles:
    """One identity's tls.crt / tls.key / ca.crt, re-read when a file changes (Kubernetes swaps a
    mounted Secret's files through a symlink; stat follows it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._signature: tuple | None = None
        self._pems: tuple[bytes, bytes, bytes] | None = None
        self.reload()
        if self._pems is None:
            self._explain()

    def _explain(self) -> None:
        """Raise what is wrong with the files, for a person to act on."""
        for name in (CERT, KEY, CA):
            path = self.directory / name
            try:
                if not path.read_bytes():
                    raise ValueError(f"TLS credentials: {path} is empty")
            except FileNotFoundError:
                raise FileNotFoundError(f"TLS credentials: {path} is missing (need {CERT}, {KEY} and {CA} in "
                                        f"{self.directory})") from None
            except PermissionError:
                try:
                    st = os.stat(path)
                    owner = f"it is owned by {st.st_uid}:{st.st_gid} with mode {st.st_mode & 0o777:o}"
                except OSError:
                    owner = f"{self.directory} is not searchable"
                raise PermissionError(
                    f"TLS credentials: cannot read {path} as uid {os.getuid()} (groups "
                    f"{sorted({os.getgid(), *os.getgroups()})}); {owner}. On Kubernetes a Secret mounted 0440 is "
                    "readable through the pod's fsGroup: set podSecurityContext.fsGroup (the chart's default is "
                    "10001)") from None
        raise FileNotFoundError(f"TLS credentials incomplete in {self.directory}: need {CERT}, {KEY} and {CA}")

    def _stat(self) -> tuple | None:
        try:
            return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in
                         (os.stat(self.directory / n) for n in (CERT, KEY, CA)))
        except OSError:
            return None

    def reload(self) -> bool:
        """Read the files again if they changed; True when they did (and were complete)."""
        signature = self._stat()
        if signature is None or signature == self._signature:
            return False
        try:
            cert, key, ca = ((self.directory / n).read_bytes() for n in (CERT, KEY, CA))
        except OSError:
            return False
        pems = (cert, key, ca)
        if not all(pems):
            return False
        with self._lock:
            self._signature, self._pems = signature, pems
        return True

    @property
    def pems(self) -> tuple[bytes, bytes, bytes]:
        assert self._pems is not None
        return self._pems

    def run(self) -> str:
        """The run named in this identity's certificate ("" if it names none)."""
        from cryptography import x509

        cert = x509.load_pem_x509_certificate(self.pems[0])
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return ""
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
            if uri.startswith(authz.SPIFFE_PREFIX):
                return uri[len(authz.SPIFFE_PREFIX):].rpartition("/")[0]
        return ""

    def server_credentials(self) -> grpc.ServerCredentials:
        def configuration() -> Any:
            cert, key, ca = self.pems
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

        def fetch() -> Any:  # gRPC calls this before each new handshake
            return configuration() if self.reload() else None

        return grpc.dynamic_ssl_server_credentials(configuration(), fetch, require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self.pems
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


_UNSET = object()
_process_dir: Any = _UNSET
_files: dict[Path, CredentialFiles] = {}
_files_lock = threading.Lock()


def use(tls_dir: str | Path | None) -> None:
    """Set this process's identity (a credentials directory), or None for plaintext; it wins over
    $OVERWORLD_TLS_DIR. The launcher and the CLI call it; tests too."""
    global _process_dir
    _process_dir = Path(tls_dir) if tls_dir else None


def reset() -> None:
    """Back to $OVERWORLD_TLS_DIR (tests)."""
    global _process_dir
    _process_dir = _UNSET


def current_dir() -> Path | None:
    if _process_dir is not _UNSET:
        return _process_dir
    value = os.environ.get(TLS_DIR_ENV)
    return Path(value) if value else None


def credentials() -> CredentialFiles | None:
    """This process's credentials, or None when it talks plaintext."""
    directory = current_dir()
    if directory is None:
        return None
    key = directory.resolve()
    with _files_lock:
        if key not in _files:
            _files[key] = CredentialFiles(directory)
        return _files[key]


# -- client channels that follow their files ----------------------------------------------------------

def _hostname_check_failed(err: grpc.RpcError) -> bool:
    return err.code() == grpc.StatusCode.UNAVAILABLE and "Hostname Verification" in (err.details() or "")


class _CheckedStream:
    """A streaming call's replies, with a failed check of the server's name raised as WrongPeer."""

    def __init__(self, call: Any, owner: ReloadingChannel) -> None:
        self._call, self._owner = call, owner

    def __iter__(self) -> _CheckedStream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as err:
            raise self._owner.explain(err) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class _Multicallable:
    """A stub's method bound to whatever channel is current (stubs bind methods once, at creation)."""

    def __init__(self, owner: ReloadingChannel, kind: str, args: tuple, kwargs: dict) -> None:
        self._owner, self._kind, self._args, self._kwargs = owner, kind, args, kwargs
        self._inner: grpc.Channel | None = None
        self._bound: Any = None

    def _current(self) -> Any:
        inner = self._owner.current()
        if inner is not self._inner:
            self._bound = getattr(inner, self._kind)(*self._args, **self._kwargs)
            self._inner = inner
        return self._bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = self._current()(*args, **kwargs)
        except grpc.RpcError as err:
            raise self._owner.explain(err) from None
        return _CheckedStream(out, self._owner) if self._kind.endswith("_stream") else out

    def future(self, *args: Any, **kwargs: Any) -> Any:
        return self._current().future(*args, **kwargs)

    def with_call(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._current().with_call(*args, **kwargs)
        except grpc.RpcError as err:
            raise self._owner.explain(err) from None


class ReloadingChannel(grpc.Channel):
    """A secure channel to `peer` (the identity the client means to reach: its server must present that
    identity's certificate) that, once its credential files change, opens a new channel with them for
    the calls that follow. Calls in flight finish on the old one (closed with this channel)."""

    def __init__(self, address: str, files: CredentialFiles, options: Sequence[tuple[str, Any]], peer: str) -> None:
        self._address, self._files, self.peer = address, files, peer
        self._options = [*options, ("grpc.ssl_target_name_override", server_name(peer))]
        self._lock = threading.Lock()
        self._pems = files.pems
        self._channel = self._open()
        self._old: list[grpc.Channel] = []
        self._checked = time.monotonic()

    def _open(self) -> grpc.Channel:
        return grpc.secure_channel(self._address, self._files.channel_credentials(), options=self._options)

    def current(self) -> grpc.Channel:
        now = time.monotonic()
        if now - self._checked >= RELOAD_CHECK_SECONDS:
            with self._lock:
                if now - self._checked >= RELOAD_CHECK_SECONDS:
                    self._checked = now
                    self._files.reload()
                    if self._files.pems != self._pems:
                        self._pems = self._files.pems
                        self._old.append(self._channel)
                        self._channel = self._open()
        return self._channel

    def explain(self, err: grpc.RpcError) -> grpc.RpcError:
        """`err`, or WrongPeer when the server failed the check of its name: it presented a certificate of
        another identity (the lookup of which costs one more handshake, on failure only)."""
        if not _hostname_check_failed(err):
            return err
        return WrongPeer(self._address, self.peer, presented_identity(self._address, self._files.directory))

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        self.current().subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Any) -> None:
        self._channel.unsubscribe(callback)

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _Multicallable(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _Multicallable(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _Multicallable(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _Multicallable(self, "stream_stream", args, kwargs)

    def close(self) -> None:
        for channel in [*self._old, self._channel]:
            channel.close()

    def __enter__(self) -> ReloadingChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def aio_channel(address: str, peer: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to `peer` (the identity its server must present) with this process's credentials
    (files read at each call: the run-controller opens one per status read)."""
    files = credentials()
    if files is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    files.reload()
    return grpc.aio.secure_channel(address, files.channel_credentials(),
                                   options=[*options, ("grpc.ssl_target_name_override", server_name(peer))])
