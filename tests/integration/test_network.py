"""Per-sandbox network policy on real namespaces: loopback only by default, allowlists changeable while running.

Only namespaces this test makes are used: a "package mirror" in a new network
namespace, plugged into the server's own sandbox network (10.88.0.0/16).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import corral
from corral.embedded import EmbeddedServer
from corral.testing.leftovers import find_leftovers
from tests.tcp_mirror import plugged_mirror

MIRROR = "10.88.200.2"
FETCH = f"echo hi | nc -w 2 {MIRROR} 8080"


@pytest.fixture(scope="module")
def mirror(server) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A TCP service in a network namespace of its own, plugged into the sandbox network."""
    with plugged_mirror(server, "mirror", MIRROR) as address:
        yield address


def test_no_network_by_default(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        assert [line.split(":")[1].strip() for line in sandbox.exec("ip -o link").stdout.splitlines()] == ["lo"]
        assert sandbox.network().address is None


def test_allowlist_lets_through_only_what_it_names(client: corral.Client, mirror: str) -> None:
    allowed = {"allow": [{"cidr": mirror, "ports": [8080], "protocol": "tcp"}]}
    with client.create("busybox", network=allowed) as open_box, client.create("busybox", network={"allow": []}) as shut:
        assert open_box.exec(FETCH).stdout == "ok from mirror\n"
        assert open_box.network().address is not None and open_box.network().address.startswith("10.88.")
        # a sandbox made with a network lists its interface in /sys as ip does (its own sysfs, not the node's)
        listed = open_box.exec("ls /sys/class/net").stdout.split()
        links = open_box.exec("ip -o link | cut -d: -f2 | cut -d@ -f1").stdout.split()
        assert len(listed) == 2 and sorted(listed) == sorted(links), (listed, links)
        assert shut.exec(FETCH, timeout_s=10).stdout == ""
        assert shut.network().denied_egress_packets > 0  # denied attempts are counted
        wrong_port = {"allow": [{"cidr": mirror, "ports": [9999]}]}
        shut.set_network(wrong_port["allow"])
        assert shut.exec(FETCH, timeout_s=10).stdout == ""


def test_policy_changes_while_running(client: corral.Client, mirror: str) -> None:
    with client.create("busybox", network={"allow": []}) as sandbox:
        assert sandbox.exec(FETCH, timeout_s=10).stdout == ""
        status = sandbox.set_network([{"cidr": f"{mirror}/32", "ports": [8080]}])  # setup phase: mirror open
        assert status.allow is not None and status.allow[0].ports == [8080]
        assert sandbox.exec(FETCH).stdout == "ok from mirror\n"
        sandbox.set_network([])  # task phase: closed again
        before = sandbox.network().denied_egress_packets
        assert sandbox.exec(FETCH, timeout_s=10).stdout == ""
        assert sandbox.network().denied_egress_packets > before
        assert client.get(sandbox.id).info.network == corral.NetworkPolicy(allow=[])


def test_a_replay_opens_and_closes_the_network_where_the_trajectory_did(client: corral.Client, mirror: str) -> None:
    """Setup phase open, task phase closed: the record holds the last policy (closed), so the replay's fetch
    reaches the mirror only because the logged policy changes are replayed in their place."""
    with client.create("busybox", network={"allow": []}) as sandbox:
        sandbox.set_network([{"cidr": f"{mirror}/32", "ports": [8080]}])
        assert sandbox.exec(FETCH).stdout == "ok from mirror\n"
        sandbox.set_network([])
        assert sandbox.exec(FETCH, timeout_s=10).stdout == ""
        result = sandbox.replay()
        copy = client.connect(corral.Sandbox(result.sandbox, sandbox.url, sandbox.api_key))
        try:
            assert (result.steps, result.skipped, result.mismatches) == (4, [], [])
            assert copy.network().allow == []
        finally:
            copy.kill()


def test_a_sandbox_without_network_can_be_plugged_in(client: corral.Client, mirror: str) -> None:
    with client.create("busybox") as sandbox:
        sandbox.set_network([{"cidr": mirror, "ports": [8080]}])
        assert sandbox.exec(FETCH).stdout == "ok from mirror\n"


def test_bad_rules_are_refused(client: corral.Client) -> None:
    for rule in [{"cidr": "not-an-address"}, {"cidr": "10.0.0.1", "ports": [0]}, {"cidr": "10.0.0.1", "ports": [70000]},
                 {"cidr": "10.0.0.1", "protocol": "icmp", "ports": [1]}]:  # fmt: skip
        with pytest.raises(corral.InvalidRequest):
            client.create("busybox", network={"allow": [rule]})


def test_builder_sandbox_can_reach_the_mirror(client: corral.Client, mirror: str) -> None:
    allow = {"allow": [{"cidr": mirror, "ports": [8080]}]}
    client.images.build(
        "from-mirror", "commands", on=["busybox"], commands=[f"{FETCH} > /fetched"], network=allow, no_cache=True
    )
    with client.create("from-mirror") as sandbox:
        assert sandbox.files.read_text("/fetched") == "ok from mirror\n"


def test_the_leftovers_check_sees_a_networked_sandboxs_veth_until_it_ends(
    client: corral.Client, server: EmbeddedServer
) -> None:
    """The veth is found in the server's router namespace, whose name only the server's mount namespace holds
    (from the host's the check used to find no veth of any server, ended or not)."""
    with client.create("busybox", network={"allow": []}) as sandbox:
        live = find_leftovers(server.data_dir, [sandbox.id], server_pid=server.process.pid).veths
        assert len(live) == 1 and live[0].endswith(f"({sandbox.id})"), live
    assert find_leftovers(server.data_dir, [sandbox.id], server_pid=server.process.pid).veths == []
