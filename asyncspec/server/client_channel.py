"""The channel the command-line clients (generate, health, bench) open: plaintext, or TLS as the server serves it."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from asyncspec.errors import ConfigError


@dataclass
class ChannelSecurity:
    tls: bool = False
    """Speak TLS, trusting the system's root certificates (implied by ca_file)."""
    ca_file: str | None = None
    """PEM file of the certificates that signed the server's (a private CA, or a self-signed server certificate)."""
    server_name: str | None = None
    """The name to check the server's certificate against, when it differs from the address's host: a probe
    dialling 127.0.0.1 inside the pod of a server whose certificate names its DNS name."""

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.ca_file is not None

    def _credentials(self) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
        roots = None
        if self.ca_file is not None:
            try:
                with open(self.ca_file, "rb") as f:
                    roots = f.read()
            except OSError as e:
                raise ConfigError(f"cannot read --tls-ca-file {self.ca_file!r}: {e}") from None
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.ssl_channel_credentials(root_certificates=roots), options

    def channel(self, address: str) -> grpc.Channel:
        if not self.uses_tls:
            if self.server_name:
                raise ConfigError("--tls-server-name needs --tls or --tls-ca-file")
            return grpc.insecure_channel(address)
        credentials, options = self._credentials()
        return grpc.secure_channel(address, credentials, options=options)

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        if not self.uses_tls:
            if self.server_name:
                raise ConfigError("--tls-server-name needs --tls or --tls-ca-file")
            return grpc.aio.insecure_channel(address)
        credentials, options = self._credentials()
        return grpc.aio.secure_channel(address, credentials, options=options)
