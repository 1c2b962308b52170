"""The gateway's header and frame encoding and its address policy (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spiderflow.core.errors import ValidationError
from spiderflow.gateway.protocol import (
    FRAME_HEADER,
    MAX_FRAME,
    Frame,
    GatewayConfig,
    GatewayPeer,
    HeaderError,
    config_to_dict,
    decode_header,
    encode_frame,
    encode_header,
    frame_header,
    gateway_config,
    header_length,
    parse_frame_header,
)


@settings(max_examples=40, deadline=None)
@given(st.ip_addresses(), st.integers(1, 65535))
def test_a_header_decodes_to_what_was_encoded(addr: object, port: int) -> None:
    data = encode_header(str(addr), port)
    assert header_length(data[:6]) == len(data)
    assert decode_header(data) == (str(addr), port)


@pytest.mark.parametrize(("data", "reason"), [
    (b"XXXX\x01\x04" + bytes(6), "magic"),
    (b"SFGW\x02\x04" + bytes(6), "version"),
    (b"SFGW\x01\x05" + bytes(6), "family"),
    (b"SFGW\x01\x04\x0a\x00\x00\x01", "expected 12"),
    (b"SFGW\x01\x04\x0a\x00\x00\x01\x00\x00", "port 0"),
])
def test_a_malformed_header_names_what_is_wrong(data: bytes, reason: str) -> None:
    with pytest.raises(HeaderError, match=reason):
        decode_header(data)


def test_encode_refuses_names_and_bad_ports() -> None:
    with pytest.raises(HeaderError, match="not an IP"):
        encode_header("example.org", 80)
    with pytest.raises(HeaderError, match="port"):
        encode_header("10.0.0.1", 0)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(list(Frame)), st.binary(max_size=64))
def test_frames_round_trip(kind: Frame, payload: bytes) -> None:
    if kind is not Frame.DATA:
        payload = b""
    data = encode_frame(kind, payload)
    assert parse_frame_header(data[:FRAME_HEADER]) == (kind, len(payload))
    assert data[FRAME_HEADER:] == payload


def test_bad_frames_are_refused() -> None:
    with pytest.raises(HeaderError, match="unknown frame type"):
        parse_frame_header(b"\x09\x00\x00\x00\x00")
    with pytest.raises(HeaderError, match="length"):
        parse_frame_header(frame_header(Frame.DATA, MAX_FRAME)[:1] + (MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(HeaderError, match="no payload"):
        frame_header(Frame.EOF, 3)
    with pytest.raises(HeaderError, match="bad RESET"):
        parse_frame_header(b"\x02\x00\x00\x00\x01")


def _config(**kw: object) -> GatewayConfig:
    base: dict[str, object] = {
        "enabled": True, "ranges": ["10.1.0.0/16"],
        "peers": [{"cluster": "west", "address": "gw.west.example.org:15443", "ranges": ["10.2.0.0/16"]},
                  {"cluster": "west-gpu", "address": "10.9.0.1:15443", "ranges": ["10.2.7.0/24"]}],
    }
    base.update(kw)
    return gateway_config(base)


def test_inbound_reaches_only_this_clusters_ranges_and_never_a_gateway_port() -> None:
    c = _config()
    assert c.allows_inbound("10.1.3.4", 29500)
    assert not c.allows_inbound("10.2.3.4", 29500)  # a peer's address: not an open proxy
    assert not c.allows_inbound("127.0.0.1", 22)
    assert not c.allows_inbound("10.1.3.4", c.port) and not c.allows_inbound("10.1.3.4", c.redirect_port)
    assert not c.allows_inbound("::1", 80) and not c.allows_inbound("not-an-ip", 80)


def test_outbound_picks_the_most_specific_peer() -> None:
    c = _config()
    assert c.peer_for("10.2.3.4").cluster == "west"  # type: ignore[union-attr]
    assert c.peer_for("10.2.7.9").cluster == "west-gpu"  # type: ignore[union-attr]
    assert c.peer_for("10.1.0.5") is None and c.peer_for("8.8.8.8") is None
    assert c.peer("west") is not None and c.peer("east") is None
    assert (c.peer("west").host, c.peer("west").port) == ("gw.west.example.org", 15443)  # type: ignore[union-attr]


def test_the_config_round_trips_through_its_mapping() -> None:
    c = _config(port=16000, redirect="0.0.0.0:16001", tls_dir="/etc/certs/agent-east")
    assert gateway_config(config_to_dict(c)) == c
    assert gateway_config(None) == GatewayConfig() and not GatewayConfig().enabled


@pytest.mark.parametrize(("override", "field"), [
    ({"port": 70000}, "gateway.port"),
    ({"redirect": "localhost"}, "gateway.redirect"),
    ({"ranges": []}, "gateway.ranges"),
    ({"ranges": ["10.1.0.0/33"]}, "gateway.ranges[0]"),
    ({"ranges": "10.1.0.0/16"}, "gateway.ranges"),
    ({"peers": [{"cluster": "w", "address": "h:1", "ranges": ["10.1.2.0/24"]}]}, "gateway.peers[w].ranges"),
    ({"peers": [{"cluster": "w", "address": "h", "ranges": ["10.3.0.0/24"]}]}, "gateway.peers[w].address"),
    ({"peers": [{"cluster": "w", "address": "h:1"}]}, "gateway.peers[0].ranges"),
    ({"peers": [{"cluster": "w", "address": "h:1", "ranges": ["10.3.0.0/24"], "x": 1}]}, "gateway.peers[0].x"),
    ({"peers": [{"cluster": "w", "address": "h:1", "ranges": ["10.3.0.0/24"]}] * 2}, "gateway.peers"),
    ({"enabled": "yes"}, "gateway.enabled"),
    ({"chunk_bytes": 10}, "gateway.chunk_bytes"),
    ({"connect_retry_s": -1}, "gateway.connect_retry_s"),
    ({"colour": "blue"}, "gateway.colour"),
])
def test_bad_config_names_the_field(override: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        _config(**override)
    assert e.value.field == field


def test_a_peer_needs_a_cluster_name() -> None:
    with pytest.raises(ValidationError, match="cluster"):
        GatewayPeer(cluster="a/b", address="h:1", ranges=("10.0.0.0/8",))
