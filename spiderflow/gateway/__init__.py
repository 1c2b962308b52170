"""One gateway per cluster: cross-cluster TCP over one mutual-TLS port (see :mod:`spiderflow.gateway.protocol`
for the wire format and policy, :mod:`spiderflow.gateway.server` for the process, docs/operations.md for
deployment)."""

from spiderflow.gateway.protocol import GatewayConfig, GatewayPeer, gateway_config

__all__ = ["GatewayConfig", "GatewayPeer", "gateway_config"]
