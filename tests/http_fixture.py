"""A real HTTP server on loopback for a test's own request handler (scripted API answers, a fleet that watches
how requests overlap), and the certificate files a TLS server in a test needs.

Use::

    with serve(Handler) as url:
        client = HotLoadClient(url, ...)
"""
from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.request import Request, urlopen


@contextmanager
def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on an ephemeral loopback port (a thread per request); yields the base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextmanager
def forwarding(target: str, before_hint: Callable[[bytes], None]) -> Iterator[str]:
    """A loopback proxy that forwards every request to ``target`` (the emulator's URL) as it came, calling
    ``before_hint(body)`` first for each per-file hint: a hint endpoint as slow, or as held back, as a test needs."""

    class Forward(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _forward(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else None
            if self.path.endswith("/hint"):
                before_hint(body or b"")
            req = Request(target + self.path, data=body, method=method,
                          headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
            with urlopen(req, timeout=60) as resp:
                data, status = resp.read(), resp.status
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._forward("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._forward("POST")

    with serve(Forward) as url:
        yield url


def tls_files(tmp_path: Path, host: str, key_ids: bool = True) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate it signs for ``host``, written under ``tmp_path``: (CA file, certificate
    file, key file). The CA is no system's: a client that does not load it fails to verify the certificate.
    Without ``key_ids`` the certificates lack their key identifiers, as many private CAs make them (which OpenSSL's
    strict mode, Python 3.13's default, refuses)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hotload test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True))
    if key_ids:
        ca = ca.add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    if key_ids:
        cert = cert.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                  critical=False)
    ca, cert = ca.sign(ca_key, hashes.SHA256()), cert.sign(ca_key, hashes.SHA256())
    paths = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths
