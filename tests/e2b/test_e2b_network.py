"""E2B egress through the real e2b SDK: allow_internet_access, network=..., update_network, host names.

No packet leaves namespaces this test makes. A "public" service is a peer
namespace plugged into the server's sandbox network that also holds
203.0.113.10 (TEST-NET-3: documentation, routed nowhere on the internet),
reached through a route the test adds inside the sandbox's own namespace; a
"private" one is the same peer's 10.88 address, which an internet grant must
not reach. The rules themselves are read from the sandbox's namespace.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import ALL_TRAFFIC, Sandbox, SandboxException

from corral.embedded import EmbeddedServer
from corral.gateway.e2b import e2b_api_key
from tests.tcp_mirror import SERVER as PEER_SERVER

PEER = "10.88.201.2"  # the peer's address on the sandbox network: private, like every 10/8 address
PUBLIC = "203.0.113.10"  # the same peer, playing a public address


def _fetch(address: str) -> str:
    """A shell line that prints what a TCP connect to address:8080 reads (nothing when refused or dropped)."""
    return f"timeout 4 bash -c 'exec 3<>/dev/tcp/{address}/8080; cat <&3' 2>/dev/null; true"


@pytest.fixture(scope="module")
def hosts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hosts = tmp_path_factory.mktemp("hosts") / "hosts"
    hosts.write_text("")
    return hosts


@pytest.fixture(scope="module")
def network_server(
    tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str], hosts_file: Path
) -> Iterator[EmbeddedServer]:
    """A server of this module's own: its hosts file is the test's, and names are resolved again every 0.5 s."""
    env = {**test_env, "CORRAL_NETWORK_HOSTS_FILE": str(hosts_file), "CORRAL_NETWORK_RESOLVE_INTERVAL_S": "0.5"}
    with EmbeddedServer(tmp_path_factory.mktemp("corral-network-server"), env=env) as server:
        yield server


@pytest.fixture(scope="module")
def peer(network_server: EmbeddedServer) -> Iterator[str]:
    """A TCP service in a namespace of its own at PEER on the sandbox network, and at PUBLIC on its loopback."""
    process = subprocess.Popen(["unshare", "--net", sys.executable, "-c", PEER_SERVER])
    try:
        time.sleep(0.3)
        netns = f"/proc/{process.pid}/ns/net"
        subprocess.run(["nsenter", f"--net={netns}", "ip", "addr", "add", f"{PUBLIC}/32", "dev", "lo"], check=True)
        subprocess.run(["nsenter", f"--net={netns}", "ip", "link", "set", "lo", "up"], check=True)
        with network_server.client() as client:
            client.attach_network_peer("e2b-peer", netns, PEER)
        yield PEER
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def create(network_server: EmbeddedServer, peer: str, e2b_sandboxes: list):  # type: ignore[no-untyped-def,type-arg]
    """Sandbox.create against this module's server; every sandbox made is killed afterwards (e2b_sandboxes)."""
    connection = {"api_key": e2b_api_key(network_server.api_key), "api_url": network_server.url,
                  "sandbox_url": network_server.url}  # fmt: skip

    def make(**options) -> Sandbox:  # type: ignore[no-untyped-def]
        sandbox = Sandbox.create("base", timeout=300, **connection, **options)
        e2b_sandboxes.append(sandbox)
        return sandbox

    return make


def _netns(sandbox: Sandbox) -> str:
    """The sandbox's network namespace, found through a process of its own with a marker name."""
    marker = f"corral-netns-{uuid.uuid4().hex[:12]}"
    sandbox.commands.run(f"exec -a {marker} sleep 600", background=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if Path(f"/proc/{entry}/cmdline").read_bytes().startswith(marker.encode()):
                        return f"/proc/{entry}/ns/net"
                except OSError:
                    continue
        time.sleep(0.1)
    raise AssertionError(f"no process {marker} found")


def _route_public_via_peer(netns: str) -> None:
    """Inside the sandbox's namespace only: PUBLIC is reached through the peer (there is no uplink)."""
    subprocess.run(["nsenter", f"--net={netns}", "ip", "route", "add", f"{PUBLIC}/32", "via", PEER], check=True)


def _output_rules(netns: str) -> list[str]:
    """The sandbox's egress rules, one nft rule a line: the output hook's and those of the allow chain it jumps to."""
    lines = []
    for chain in ("output", "allowed_out"):
        listing = subprocess.run(
            ["nsenter", f"--net={netns}", "nft", "list", "chain", "inet", "corral", chain],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        lines += [line.strip() for line in listing.splitlines() if "daddr" in line or line.strip().startswith("oif")]
    return lines


def _denied(server: EmbeddedServer, sandbox: Sandbox) -> int:
    with server.client() as client:
        return client.get(sandbox.sandbox_id).network().denied_egress_packets


def test_internet_access_reaches_public_addresses_only(create, network_server: EmbeddedServer) -> None:  # type: ignore[no-untyped-def]
    sandbox = create(allow_internet_access=True)  # what e2b 2.45 sends on every create
    netns = _netns(sandbox)
    rules = _output_rules(netns)
    for private in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "127.0.0.0/8",
                    "169.254.0.0/16", "fe80::/10", "fc00::/7", "::ffff:0.0.0.0/96"):  # fmt: skip
        assert any(f"daddr {private}" in rule and "drop" in rule for rule in rules), (private, rules)
    accepts = [rule for rule in rules if rule.endswith("accept")]
    assert accepts[-2:] == ["ip daddr 0.0.0.0/0 accept", "ip6 daddr ::/0 accept"]  # after every private drop
    assert rules.index('ip daddr 169.254.0.0/16 counter name "egress_denied" drop') < rules.index(accepts[-2])
    _route_public_via_peer(netns)
    assert sandbox.commands.run(_fetch(PUBLIC)).stdout == "ok from mirror\n"
    before = _denied(network_server, sandbox)
    assert sandbox.commands.run(_fetch(PEER)).stdout == ""  # the same service at a private address: dropped
    assert sandbox.commands.run(_fetch("169.254.169.254")).stdout == ""  # the metadata address
    assert _denied(network_server, sandbox) > before  # and counted


def test_no_internet_access_is_loopback_only(create) -> None:  # type: ignore[no-untyped-def]
    sandbox = create(allow_internet_access=False)
    links = sandbox.commands.run("ls /sys/class/net").stdout.split()
    assert links == ["lo"]  # as a Corral sandbox without network: no interface to send on
    info = sandbox.get_info()
    assert info.allow_internet_access is False and info.network == {"allow_public_traffic": False}


def test_a_server_can_forbid_internet(tmp_path: Path, test_env: dict[str, str]) -> None:
    with EmbeddedServer(tmp_path / "server", env={**test_env, "CORRAL_INTERNET_EGRESS": "off"}) as server:
        connection = {"api_key": e2b_api_key(server.api_key), "api_url": server.url, "sandbox_url": server.url}
        with pytest.raises(SandboxException, match=r"CORRAL_INTERNET_EGRESS=off"):
            Sandbox.create("base", allow_internet_access=True, **connection)
        sandbox = Sandbox.create("base", **connection)  # unset: no internet, and no error
        try:
            assert sandbox.commands.run("ls /sys/class/net").stdout.split() == ["lo"]
        finally:
            sandbox.kill()


def _wait_for(check, timeout_s: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_network_allow_and_deny_with_host_names_kept_current(  # type: ignore[no-untyped-def]
    create, network_server: EmbeddedServer, hosts_file: Path
) -> None:
    hosts_file.write_text(f"{PEER} mirror.corral.test\n")
    sandbox = create(network={"allow_out": ["mirror.corral.test"], "deny_out": [ALL_TRAFFIC]})
    info = sandbox.get_info()  # as configured: unset internet access is E2B's default, on
    assert info.allow_internet_access is True
    assert info.network == {
        "allow_out": ["mirror.corral.test"],
        "deny_out": [ALL_TRAFFIC],
        "allow_public_traffic": False,
    }
    netns = _netns(sandbox)
    _route_public_via_peer(netns)
    assert f"ip daddr {PEER} accept" in _output_rules(netns)  # the name, resolved on the node
    assert sandbox.commands.run(_fetch(PEER)).stdout == "ok from mirror\n"
    assert sandbox.commands.run(_fetch(PUBLIC)).stdout == ""  # deny_out 0.0.0.0/0: no internet either
    hosts_file.write_text("10.88.201.99 mirror.corral.test\n")  # the name moves
    _wait_for(lambda: "ip daddr 10.88.201.99 accept" in _output_rules(netns))
    assert f"ip daddr {PEER} accept" not in _output_rules(netns)
    before = _denied(network_server, sandbox)
    assert sandbox.commands.run(_fetch(PEER)).stdout == ""  # the old address is closed at once
    assert _denied(network_server, sandbox) > before
    with network_server.client() as client:  # denied attempts become audit events too
        _wait_for(lambda: any(e.kind == "network_denied" for e in client.get(sandbox.sandbox_id).audit_events()))


def test_update_network_replaces_the_rules(create, network_server: EmbeddedServer) -> None:  # type: ignore[no-untyped-def]
    sandbox = create(allow_internet_access=False)  # loopback only at first
    sandbox.update_network(
        {"allow_out": ["10.88.201.0/24"], "dns_servers": ["10.88.201.53"], "allow_internet_access": False}
    )
    info = sandbox.get_info()
    assert info.allow_internet_access is False
    assert info.network == {
        "allow_out": ["10.88.201.0/24"],
        "dns_servers": ["10.88.201.53"],
        "allow_public_traffic": False,
    }
    netns = _netns(sandbox)
    _route_public_via_peer(netns)
    assert sandbox.commands.run(_fetch(PEER)).stdout == "ok from mirror\n"
    assert sandbox.commands.run(_fetch(PUBLIC)).stdout == ""
    sandbox.update_network({"deny_out": [PEER]})  # replaced: internet (E2B's default) on, the peer denied
    assert sandbox.commands.run(_fetch(PUBLIC)).stdout == "ok from mirror\n"
    assert sandbox.commands.run(_fetch(PEER)).stdout == ""
    info = sandbox.get_info()
    assert info.allow_internet_access is True and info.network == {"deny_out": [PEER], "allow_public_traffic": False}
    with network_server.client() as client:
        rules = client.get(sandbox.sandbox_id).network().allow
    assert rules is not None and rules[0].cidr == f"{PEER}/32" and rules[0].action == "deny"


def test_network_options_corral_cannot_honour_are_refused(create) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SandboxException, match="network.egressProxy is not supported"):
        create(network={"egress_proxy": {"address": "127.0.0.1:1080"}})
    with pytest.raises(SandboxException, match="wildcard host"):
        create(network={"allow_out": ["*.example.com"]})
    public = create(network={"allow_public_traffic": True, "allow_out": [PEER]})  # E2B's default: accepted,
    assert public.get_info().network["allow_public_traffic"] is False  # and the access token is still needed
