"""`grpo-mesh certs DIR`: the demo's throwaway TLS material for services run by hand."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from cryptography import x509

from services.launch.certs import main


def test_certs_writes_the_material_and_the_security_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tls = tmp_path / "tls"
    assert main([str(tls), "--hosts", "learner,env"]) == 0
    out = capsys.readouterr().out
    table = tomllib.loads(out.split("\n\n")[1])["security"]  # the printed [security] table
    assert table["require_client_cert"] is True
    for key in ("tls_cert", "tls_key", "tls_ca", "token_file"):
        assert Path(table[key]).is_file(), key
    cert = x509.load_pem_x509_certificate((tls / "service.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "learner", "env"} <= set(names.get_values_for_type(x509.DNSName))
    assert (tls / "operator.key").stat().st_mode & 0o077 == 0


def test_certs_keeps_existing_credentials_unless_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path)]) == 0
    ca = (tmp_path / "ca.pem").read_bytes()
    assert main([str(tmp_path)]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "ca.pem").read_bytes() == ca
    assert main([str(tmp_path), "--overwrite"]) == 0
    assert (tmp_path / "ca.pem").read_bytes() != ca
