"""Why a peer was refused: it presented a certificate of the run, but of another identity than the one
the client meant to reach (core/security/tls.py checks the name; this says what was there instead)."""

from __future__ import annotations

from pathlib import Path

import grpc

from overworld.core.security import authz


class WrongPeer(grpc.RpcError):
    """The server at an address presented a certificate that is not of the identity the client meant to
    reach: another identity of the run (a rollout worker where the registry should be), or not of the run
    at all. Not retried (UNAUTHENTICATED): talking to it would hand the wrong peer what the real one gets."""

    def __init__(self, address: str, expected: str, presented: str) -> None:
        super().__init__(address, expected, presented)
        self.address, self.expected, self.presented = address, expected, presented

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAUTHENTICATED

    def details(self) -> str:
        return (f"the server at {self.address} presented {self.presented}, not the {self.expected} this client "
                f"meant to reach: refused (a wrong address, or a peer posing as {self.expected}; see \"Security\" "
                "in docs/operations.md)")

    def __str__(self) -> str:
        return self.details()


def certificate_identity(der: bytes) -> tuple[str, str]:
    """(run, identity) a certificate names in its SPIFFE URI (run "" and the common name without one)."""
    from cryptography import x509

    cert = x509.load_der_x509_certificate(der)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
            if uri.startswith(authz.SPIFFE_PREFIX):
                run, _, identity = uri[len(authz.SPIFFE_PREFIX):].rpartition("/")
                return run, identity
    except x509.ExtensionNotFound:
        pass
    names = cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)
    return "", str(names[0].value) if names else "?"


def presented_identity(address: str, credentials: Path, timeout: float = 3.0) -> str:
    """What the server at `address` presents, in words ("rollout-worker's certificate of run r1"),
    checked against the CA of the identity in `credentials` (a tls.crt/tls.key/ca.crt directory) but not
    against any name: why a handshake that checked the name failed. Looked up only after such a failure."""
    import socket
    import ssl

    host, _, port = address.rpartition(":")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_cert_chain(credentials / "tls.crt", credentials / "tls.key")
    ctx.load_verify_locations(credentials / "ca.crt")
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock, \
                ctx.wrap_socket(sock) as conn:
            der = conn.getpeercert(binary_form=True)
    except ssl.SSLCertVerificationError:
        return "a certificate not of this run's CA"
    except (OSError, ValueError) as err:
        return f"a certificate that could not be read ({err})"
    if der is None:
        return "no certificate"
    run, identity = certificate_identity(der)
    return f"{identity}'s certificate of run {run}" if run else f"the certificate of {identity!r}"
