"""Channel settings shared by Client and AsyncClient: target, TLS, API key, load balancing."""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

API_KEY_ENV = "TOKENSPOUT_API_KEY"
# Streams can be long and messages small; keepalive pings keep idle connections through NATs.
_DEFAULT_OPTIONS = [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_permit_without_calls", 0)]


@dataclass(frozen=True)
class Tls:
    """TLS settings; all PEM bytes. No root_certificates means the system roots."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name: str | None = None
    """The name to check the certificate against, when it differs from the address."""

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


@dataclass(frozen=True)
class ChannelSpec:
    target: str
    options: list[tuple[str, object]]
    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]


def _target(addresses: Sequence[str]) -> str:
    """One address as given; several as an ipv4:/ipv6: list, which gRPC resolves to all of them."""
    if len(addresses) == 1:
        return addresses[0]
    hosts = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            hosts.append((ipaddress.ip_address(host.strip("[]")), port))
        except ValueError:
            raise ValueError(
                f"{address!r}: several addresses must be IP literals; for host names give one"
                " DNS name that resolves to every server (round_robin then spreads calls across them)"
            ) from None
    versions = {ip.version for ip, _ in hosts}
    if len(versions) != 1:
        raise ValueError("several addresses must all be IPv4 or all IPv6")
    scheme = "ipv4" if versions == {4} else "ipv6"
    return scheme + ":" + ",".join(f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}" for ip, port in hosts)


def channel_spec(
    address: str | Sequence[str],
    *,
    api_key: str | None,
    tls: bool | Tls,
    round_robin: bool | None,
    options: Sequence[tuple[str, object]] = (),
) -> ChannelSpec:
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses:
        raise ValueError("give at least one address")
    channel_options: list[tuple[str, object]] = [*_DEFAULT_OPTIONS]
    if round_robin if round_robin is not None else len(addresses) > 1:
        # A client-side service config (the server need not offer one), as deploy/grpc-service-config.json
        # but without its retryPolicy: this client retries by itself, honouring the server's RetryInfo.
        # Health checking keeps new calls off a replica that is draining (NOT_SERVING).
        config = {
            "loadBalancingConfig": [{"round_robin": {}}],
            "healthCheckConfig": {"serviceName": "tokenspout.v1.GenerationService"},
        }
        channel_options.append(("grpc.service_config", json.dumps(config)))
    tls_settings = Tls() if tls is True else tls or None
    if tls_settings and tls_settings.server_name:
        channel_options.append(("grpc.ssl_target_name_override", tls_settings.server_name))
    channel_options += list(options)
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    return ChannelSpec(
        target=_target(addresses),
        options=channel_options,
        credentials=tls_settings.credentials() if tls_settings else None,
        metadata=metadata,
    )
