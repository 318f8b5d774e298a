"""Sandbox networking: the per-edge fabric and each sandbox's egress policy.

Owns one router network namespace per fabric (``corral-<fabric_id>``, under
/run/netns) holding bridge ``br0`` at 10.88.0.1/16, the veth pairs that plug
sandbox (and peer) namespaces into it, the address allocation, and the
nftables table ``inet corral`` inside every sandbox namespace it is handed.

Safety rules this module keeps:

- It changes only the router namespace it created and the namespaces it is
  handed by path; a path naming the host's own namespace is refused, so the
  host's interfaces, routes, sysctls and nftables are never touched.
  ``ip_forward`` is set inside the router namespace only.
- A sandbox's policy is loaded before its interface exists, and every change
  is one nftables transaction (``nftables.run``: libnftables in this process),
  so there is never a moment without rules.
- Policy lives in the sandbox's own namespace, so the sandbox must run without
  CAP_NET_ADMIN (it could rewrite the rules) and without CAP_NET_RAW (packet
  sockets bypass netfilter).
- Egress is checked per packet, not only per connection: a revoked destination
  stops working at once, even for connections already open.

Allocation is kept in memory. After an edge restart, ``start()`` reuses the
router namespace and its veths, and the caller re-registers each sandbox it
still runs with ``adopt(sandbox_id, address)`` from its own records.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import heapq
import ipaddress
import json
import os
import re
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from corral.api.errors import CapacityExhausted, Conflict, InternalError, InvalidRequest, NotFound
from corral.api.models import NetworkRule
from corral.backends.common import nftables

__all__ = [
    "AllowRule", "DeniedCounts", "HostResolver", "NetworkFabric", "NON_PUBLIC_NETWORKS", "SUBNET", "GATEWAY",
    "GUEST_LINK_IFNAME", "MAX_ALLOW_RULES", "clear_stale_name", "internet_rules", "is_namespace", "sandbox_veth_name",
    "to_allow_rules",
]  # fmt: skip

IpProtocol = Literal["tcp", "udp", "icmp", "any"]
RuleAction = Literal["allow", "deny"]
SUBNET = ipaddress.IPv4Network("10.88.0.0/16")
GATEWAY = ipaddress.IPv4Address("10.88.0.1")
MAX_ALLOW_RULES = 256
_BRIDGE = "br0"
_SANDBOX_IFNAME = "eth0"
GUEST_LINK_IFNAME = "tap0"  # in a VM sandbox's namespace: the tap device its guest's NIC sits on
_COMMAND_TIMEOUT_S = 10
_FIRST_HOST, _LAST_HOST = 2, SUBNET.num_addresses - 2  # .0.0 is the network, .0.1 the gateway, the last broadcast
_SAFE_PATH = re.compile(r"/[A-Za-z0-9_./-]+")
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")
_HOST_NAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
)
DEFAULT_RESOLVE_INTERVAL_S = 30.0


@dataclass(frozen=True)
class AllowRule:
    """Let a sandbox send to ``cidr`` (or to every address ``host`` resolves to):
    TCP or UDP (to ``ports``, or to any port when empty), ICMP, or ``any``
    protocol. With ``action="deny"`` the same match is dropped and counted
    instead. A policy's rules are tried in order and the first match decides.
    Validated on construction; ``cidr`` and ``ports`` are stored in canonical form."""

    cidr: str | None = None
    ports: tuple[int, ...] = ()
    protocol: IpProtocol = "tcp"
    host: str | None = None
    action: RuleAction = "allow"

    def __post_init__(self) -> None:
        if self.protocol not in get_args(IpProtocol):
            raise InvalidRequest(f"protocol {self.protocol!r} is not one of {', '.join(get_args(IpProtocol))}")
        if self.action not in get_args(RuleAction):
            raise InvalidRequest(f"action {self.action!r} is not one of {', '.join(get_args(RuleAction))}")
        if (self.cidr is None) == (self.host is None):
            raise InvalidRequest("a rule names exactly one of cidr (e.g. '10.0.0.0/8') or host (e.g. 'pypi.org')")
        if self.host is not None and (not isinstance(self.host, str) or not _HOST_NAME.fullmatch(self.host)):
            raise InvalidRequest(f"host {self.host!r} is not a DNS name such as 'pypi.org'")
        if self.cidr is not None:
            if not isinstance(self.cidr, str):
                raise InvalidRequest(f"cidr must be a string like '10.0.0.0/8', not {self.cidr!r}")
            try:
                network = ipaddress.ip_network(self.cidr, strict=True)
            except ValueError as exc:
                raise InvalidRequest(f"cidr {self.cidr!r} is not a valid network: {exc}") from None
            object.__setattr__(self, "cidr", str(network))
        if not isinstance(self.ports, list | tuple):
            raise InvalidRequest(f"ports must be a list of integers, not {self.ports!r}")
        for port in self.ports:
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise InvalidRequest(f"port {port!r} is not an integer from 1 to 65535")
        if self.ports and self.protocol in ("icmp", "any"):
            raise InvalidRequest(f"protocol {self.protocol!r} takes no ports; use tcp or udp to allow ports")
        object.__setattr__(self, "ports", tuple(sorted(set(self.ports))))

    @staticmethod
    def parse(spec: Mapping[str, Any]) -> AllowRule:
        """Build a rule from ``{"cidr": "10.0.0.0/8", "ports": [443], "protocol": "tcp"}`` (or ``host``,
        and ``action``)."""
        if not isinstance(spec, Mapping):
            raise InvalidRequest(f"an allow rule must be an object with cidr, ports and protocol, not {spec!r}")
        unknown = set(spec) - {"cidr", "host", "ports", "protocol", "action"}
        if unknown:
            raise InvalidRequest(
                f"unknown allow rule field(s) {sorted(unknown)}; expected cidr or host, ports, protocol, action"
            )
        if "cidr" not in spec and "host" not in spec:
            raise InvalidRequest("an allow rule needs a cidr, e.g. {'cidr': '10.0.0.0/8'}, or a host")
        return AllowRule(
            cidr=spec.get("cidr"),
            ports=spec.get("ports", ()),
            protocol=spec.get("protocol", "tcp"),
            host=spec.get("host"),
            action=spec.get("action", "allow"),
        )

    def nft_match(self, address: str | None = None) -> str:
        """This rule as an nftables match expression (built only from validated values); a host rule matches
        one of its resolved addresses, given as ``address``."""
        network = ipaddress.ip_network(address if address is not None else self.cidr)  # type: ignore[arg-type]
        family, icmp = ("ip", "icmp") if network.version == 4 else ("ip6", "ipv6-icmp")
        match = f"{family} daddr {network}"
        if self.protocol == "any":
            return match
        if self.protocol == "icmp":
            return f"{match} meta l4proto {icmp}"
        if not self.ports:
            return f"{match} meta l4proto {self.protocol}"
        return f"{match} {self.protocol} dport {{ {', '.join(map(str, self.ports))} }}"


def to_allow_rules(allow: Sequence[NetworkRule]) -> tuple[AllowRule, ...]:
    """API rules to the fabric's (validated there: InvalidRequest on a bad one). A rule is parsed once: an E2B
    create's internet grant is the same 20 rules every time (their CIDRs' parse, ~15 us each, came to ~0.3 ms a
    create and again at each spec made of its record)."""
    return tuple(_allow_rule(r.cidr, tuple(r.ports), r.protocol, r.host, r.action) for r in allow)


@functools.lru_cache(maxsize=4096)
def _allow_rule(
    cidr: str | None, ports: tuple[int, ...], protocol: IpProtocol, host: str | None, action: RuleAction
) -> AllowRule:
    return AllowRule(cidr=cidr, ports=ports, protocol=protocol, host=host, action=action)  # frozen: safe to share


# Destinations an internet grant never reaches: "this network", RFC 1918, CGNAT (RFC 6598), loopback, link-local
# (which holds the cloud metadata address 169.254.169.254), IETF protocol assignments, benchmarking, multicast and
# reserved; for IPv6 the unspecified and loopback addresses, IPv4-mapped and NAT64 (either could name a private
# IPv4 address), unique-local, link-local and multicast. The documentation ranges (192.0.2.0/24, 198.51.100.0/24,
# 203.0.113.0/24, 2001:db8::/32) are not routed on the internet, so they stay open: tests use them to play a
# public address inside namespaces of their own.
NON_PUBLIC_NETWORKS = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
    "::/128", "::1/128", "::ffff:0:0/96", "64:ff9b::/96", "fc00::/7", "fe80::/10", "ff00::/8",
)  # fmt: skip


@functools.cache
def internet_rules() -> tuple[AllowRule, ...]:
    """Public addresses only: every non-public range denied (and counted), then everything else allowed.
    Put after a sandbox's own rules, so an explicit allow (a mirror on the sandbox network) still wins.
    Made once: the rules are frozen."""
    denied = tuple(AllowRule(cidr, protocol="any", action="deny") for cidr in NON_PUBLIC_NETWORKS)
    return (*denied, AllowRule("0.0.0.0/0", protocol="any"), AllowRule("::/0", protocol="any"))


class HostResolver:
    """Host names in rules to addresses, with the node's resolver (getaddrinfo: /etc/hosts, then DNS);
    ``hosts_file`` (the /etc/hosts format) is read first, for names of peers on the sandbox network.
    A name that does not resolve gives no address, so its rule lets nothing through until it does."""

    def __init__(self, hosts_file: Path | None = None) -> None:
        self.hosts_file = hosts_file

    def resolve(self, host: str) -> tuple[str, ...]:
        listed = self._from_hosts_file(host)
        if listed:
            return listed
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return ()
        return tuple(sorted({str(info[4][0]).partition("%")[0] for info in infos}))

    def _from_hosts_file(self, host: str) -> tuple[str, ...]:
        if self.hosts_file is None:
            return ()
        try:
            text = self.hosts_file.read_text()
        except OSError:
            return ()
        found = set()
        for line in text.splitlines():
            fields = line.partition("#")[0].split()
            if len(fields) > 1 and host.lower() in (name.lower() for name in fields[1:]):
                with contextlib.suppress(ValueError):
                    found.add(str(ipaddress.ip_address(fields[0])))
        return tuple(sorted(found))


@dataclass(frozen=True)
class DeniedCounts:
    """Packets and bytes the sandbox's policy dropped since its table was created."""

    egress_packets: int
    egress_bytes: int
    ingress_packets: int
    ingress_bytes: int


def _run(argv: list[str], stdin: str | None = None, ok_if: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command; a failure raises InternalError unless its stderr contains ``ok_if``."""
    try:
        proc = subprocess.run(
            argv, input=stdin, check=False, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InternalError(f"`{shlex.join(argv)}` failed: {exc}") from exc
    if proc.returncode != 0 and (ok_if is None or ok_if not in proc.stderr):
        raise InternalError(f"`{shlex.join(argv)}` exited with {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _existing_netns(path: str) -> str:
    """``path`` if it names a network namespace other than the host's, else raise."""
    if not isinstance(path, str) or not _SAFE_PATH.fullmatch(path):
        raise InvalidRequest(f"network namespace path {path!r} must be absolute, e.g. /proc/<pid>/ns/net")
    try:
        target = os.stat(path)
    except OSError as exc:
        raise NotFound(f"network namespace {path} does not exist: {exc.strerror}") from None
    for host in ("/proc/self/ns/net", "/proc/1/ns/net"):  # pid 1's may be unreadable inside a container
        with contextlib.suppress(OSError):
            if (target.st_dev, target.st_ino) == (os.stat(host).st_dev, os.stat(host).st_ino):
                raise InvalidRequest(f"refusing to change the host's network namespace ({path} is {host})")
    return path


_ALLOWED_OUT = "allowed_out"  # the sandbox's own rules, in order: a regular chain the output hook jumps to
_ALLOWED_FORWARD = "allowed_forward"  # the same rules for a VM's guest, jumped to from the forward hook


def is_namespace(path: str) -> bool:
    """Whether ``path`` names a network namespace in this process's mount namespace. A name under /run/netns is a
    bind mount of the namespace onto an empty file; a server's names live in its own mount namespace and end with
    it, leaving the empty file: a restarted server must not take that for the namespace (it would fail to enter
    it) nor fail to make the name again (``ip netns add`` refuses a file that exists)."""
    try:
        return os.stat(path).st_dev == os.stat("/proc/self/ns/net").st_dev  # nsfs: one device for every namespace
    except OSError:
        return False


def clear_stale_name(path: str) -> None:
    """Remove a name's empty file left by a mount namespace that ended (see ``is_namespace``)."""
    if not is_namespace(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _policy_matches(rules: Sequence[AllowRule], resolve: HostResolver | None = None) -> list[tuple[str, str]]:
    """Each rule as (nft match, verdict), in the rules' order; host rules become one per address ``resolve`` gives
    now (none without it). Validates the rules."""
    if len(rules) > MAX_ALLOW_RULES:
        raise InvalidRequest(f"{len(rules)} allow rules is more than the limit of {MAX_ALLOW_RULES}; merge CIDRs")
    for rule in rules:
        if not isinstance(rule, AllowRule):
            raise InvalidRequest(f"allow rules must be AllowRule instances, not {rule!r}")
    matches: list[tuple[str, str]] = []
    for rule in rules:
        addresses = (None,) if rule.host is None else (resolve.resolve(rule.host) if resolve else ())
        verdict = "accept" if rule.action == "allow" else 'counter name "egress_denied" drop'
        matches += [(rule.nft_match(address), verdict) for address in addresses]
    return matches


def _allowed_lines(matches: list[tuple[str, str]]) -> list[str]:
    """The rules added to the two allow chains (the output hook's and a VM guest's forward hook's)."""
    return [f"add rule inet corral {chain} {match} {verdict}"
            for chain in (_ALLOWED_OUT, _ALLOWED_FORWARD) for match, verdict in matches]  # fmt: skip


def _render_policy(rules: Sequence[AllowRule], resolve: HostResolver | None = None) -> str:
    """The whole ``inet corral`` table as one transaction: declaring the table,
    counters and chains is a no-op when they exist (counters keep counting), and
    flushing the chains then re-adding rules replaces the old policy atomically.
    The rules live in regular chains the hooks jump to (their accept or drop ends
    the hook's evaluation; no match returns to the hook's final drop), so a closed
    policy takes a list by additions alone (``_render_additions``).
    Host rules become one line per address ``resolve`` gives now (none without it)."""
    return _policy_text(_policy_matches(rules, resolve))


def _policy_text(matches: list[tuple[str, str]]) -> str:
    lines = [
        "table inet corral {",
        "  counter egress_denied { }",
        "  counter ingress_denied { }",
        f"  chain {_ALLOWED_OUT} {{\n  }}",
        f"  chain {_ALLOWED_FORWARD} {{\n  }}",
        "  chain output {\n    type filter hook output priority 0; policy drop;\n  }",
        "  chain input {\n    type filter hook input priority 0; policy drop;\n  }",
        "  chain forward {\n    type filter hook forward priority 0; policy drop;\n  }",
        "}",
        "flush chain inet corral output",
        "flush chain inet corral input",
        "flush chain inet corral forward",
        f"flush chain inet corral {_ALLOWED_OUT}",
        f"flush chain inet corral {_ALLOWED_FORWARD}",
        *_allowed_lines(matches),
        "add rule inet corral output oif lo accept",
        f"add rule inet corral output jump {_ALLOWED_OUT}",
        'add rule inet corral output counter name "egress_denied" drop',
        "add rule inet corral input iif lo accept",
        "add rule inet corral input ct state established,related accept",
        'add rule inet corral input counter name "ingress_denied" drop',
        # A VM's namespace routes its guest (behind GUEST_LINK_IFNAME) out: the same list, on the forward hook.
        "add rule inet corral forward ct state established,related accept",
        f'add rule inet corral forward iifname "{GUEST_LINK_IFNAME}" jump {_ALLOWED_FORWARD}',
        f'add rule inet corral forward iifname "{GUEST_LINK_IFNAME}" counter name "egress_denied" drop',
        'add rule inet corral forward counter name "ingress_denied" drop',
    ]
    return "\n".join(lines) + "\n"


_CLOSED = _policy_text([])  # a policy with no rules: what a warm pool's networked sandbox starts with


def _render_additions(matches: list[tuple[str, str]]) -> str:
    """A closed policy (loaded by ``_render_policy`` with no rules) given ``matches``: additions to its empty
    allow chains only: a transaction that deletes no rule leaves the kernel nothing to release behind an RCU grace
    period (what a netfilter socket's close waits for while it is pending: 10-25 ms here), and it is atomic the
    same way."""
    return "".join(line + "\n" for line in _allowed_lines(matches))


def _load_policy(netns_path: str, text: str) -> None:
    nftables.run(netns_path, text)


@dataclass
class _Loaded:
    """A sandbox's policy as loaded: re-rendered when its host names may resolve differently."""

    netns_path: str
    rules: tuple[AllowRule, ...]
    text: str


def _veth_name(prefix: str, key: str) -> str:
    """A stable interface name within IFNAMSIZ (15 chars): prefix + 10 hex digits."""
    return prefix + hashlib.sha256(key.encode()).hexdigest()[:10]


def sandbox_veth_name(sandbox_id: str) -> str:
    """The router namespace's end of a sandbox's veth pair."""
    return _veth_name("cv", sandbox_id)


def _host_index(address: str) -> int:
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError as exc:
        raise InvalidRequest(f"address {address!r} is not an IPv4 address: {exc}") from None
    index = int(ip) - int(SUBNET.network_address)
    if not _FIRST_HOST <= index <= _LAST_HOST:
        raise InvalidRequest(f"address {address} must be a host address in {SUBNET} other than the gateway {GATEWAY}")
    return index


class NetworkFabric:
    """One edge's router namespace and the sandboxes and peers plugged into it.

    Thread-safe: allocation is under a lock, the commands run outside it.
    """

    def __init__(
        self,
        fabric_id: str,
        *,
        resolver: HostResolver | None = None,
        resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S,
    ) -> None:
        if not isinstance(fabric_id, str) or not _SAFE_ID.fullmatch(fabric_id):
            raise InvalidRequest(f"fabric id {fabric_id!r} must be 1-40 letters, digits, '_', '.' or '-'")
        self.fabric_id = fabric_id
        self.resolver = resolver or HostResolver()
        self.resolve_interval_s = resolve_interval_s
        self._resolved_at = time.monotonic()
        self.namespace = f"corral-{fabric_id}"
        self.namespace_path = f"/run/netns/{self.namespace}"
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._started = False
        self._sandboxes: dict[str, int] = {}
        self._loaded: dict[str, _Loaded] = {}  # sandbox id -> its policy as loaded
        self._policy_locks: dict[str, threading.Lock] = {}  # netns path -> held while its policy changes
        self._peers: dict[str, int] = {}
        self._used: set[int] = set()
        self._freed: list[int] = []  # a heap, so freed addresses are reused lowest first
        self._next = _FIRST_HOST

    def start(self) -> None:
        """Create the router namespace and bridge, or reuse them if they exist."""
        if not is_namespace(self.namespace_path):
            clear_stale_name(self.namespace_path)
            _run(["ip", "netns", "add", self.namespace])
        if _run(["ip", "-n", self.namespace, "link", "show", _BRIDGE], ok_if="does not exist").returncode != 0:
            # A fixed MAC: otherwise the bridge takes its lowest port's, and sandboxes' ARP entries go stale.
            mac = "02:" + ":".join(f"{b:02x}" for b in hashlib.sha256(self.fabric_id.encode()).digest()[:5])
            _run(
                ["ip", "-n", self.namespace, "-batch", "-"],
                f"link set lo up\nlink add {_BRIDGE} address {mac} type bridge\nlink set {_BRIDGE} addrgenmode none\n"
                f"addr add {GATEWAY}/{SUBNET.prefixlen} dev {_BRIDGE}\nlink set {_BRIDGE} up\n",
            )
        _run(["nsenter", f"--net={self.namespace_path}", "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        self._started = True

    def attach(self, sandbox_id: str, netns_path: str, rules: Sequence[AllowRule]) -> str:
        """Apply the policy, then plug the sandbox in as ``eth0``; returns its address."""
        netns = _existing_netns(netns_path)
        text = _render_policy(rules, self.resolver)  # validates before allocating anything
        with self._lock:
            self._require_started()
            if sandbox_id in self._sandboxes:
                raise Conflict(f"sandbox {sandbox_id} is already attached to fabric {self.fabric_id}")
            index = self._sandboxes[sandbox_id] = self._allocate()
        try:
            _load_policy(netns, text)
            with self._lock:
                self._loaded[sandbox_id] = _Loaded(netns, tuple(rules), text)
            self._plug(sandbox_veth_name(sandbox_id), netns, _SANDBOX_IFNAME, index, as_sandbox=True)
        except BaseException:
            with self._lock:
                self._release(self._sandboxes.pop(sandbox_id))
                self._loaded.pop(sandbox_id, None)
            raise
        return str(SUBNET.network_address + index)

    def set_policy(self, netns_path: str, rules: Sequence[AllowRule]) -> None:
        """Replace the sandbox's allow list in one transaction; denied counters keep counting. A closed policy
        this fabric loaded (an empty list: a warm pool's networked sandbox at its claim) is only added to."""
        netns = _existing_netns(netns_path)
        matches = _policy_matches(rules, self.resolver)
        with self._policy_lock(netns):  # one change at a time per namespace: additions find the chains as recorded
            with self._lock:
                loaded = [loaded for loaded in self._loaded.values() if loaded.netns_path == netns]
            text = _policy_text(matches)
            if len(loaded) == 1 and loaded[0].text == _CLOSED:  # this fabric loaded it closed: its chains are empty
                if matches:
                    _load_policy(netns, _render_additions(matches))
            else:
                _load_policy(netns, text)
            with self._lock:
                for entry in loaded:
                    entry.rules, entry.text = tuple(rules), text

    def _policy_lock(self, netns: str) -> threading.Lock:
        """The lock held while ``netns``'s policy changes (detach drops it)."""
        with self._lock:
            return self._policy_locks.setdefault(netns, threading.Lock())

    def refresh_hosts(self) -> int:
        """Once per ``resolve_interval_s``: resolve the host names in attached sandboxes' rules again and reload
        each policy whose addresses changed (one transaction each). Returns how many were reloaded."""
        now = time.monotonic()
        if now - self._resolved_at < self.resolve_interval_s:
            return 0
        self._resolved_at = now
        with self._lock:
            hosted = [(sid, loaded) for sid, loaded in self._loaded.items() if any(r.host for r in loaded.rules)]
        reloaded = 0
        for sandbox_id, loaded in hosted:
            with self._policy_lock(loaded.netns_path):
                text = _render_policy(loaded.rules, self.resolver)
                if text == loaded.text:
                    continue
                with self._lock:
                    if self._loaded.get(sandbox_id) is not loaded:
                        continue  # detached or replaced meanwhile
                _load_policy(loaded.netns_path, text)
                loaded.text = text
            reloaded += 1
        return reloaded

    def denied(self, netns_path: str) -> DeniedCounts:
        netns = _existing_netns(netns_path)
        try:
            listed = nftables.run(netns, "list counters table inet corral", json_output=True)
        except nftables.NftError as exc:
            if "No such file or directory" not in exc.detail:
                raise
            raise NotFound(f"no Corral network policy in {netns_path}: attach or apply_isolation first") from None
        listing = json.loads(listed).get("nftables", [])
        counters = {item["counter"]["name"]: item["counter"] for item in listing if "counter" in item}
        try:
            egress, ingress = counters["egress_denied"], counters["ingress_denied"]
        except KeyError as exc:
            raise InternalError(f"table inet corral in {netns_path} has no counter {exc}") from None
        return DeniedCounts(egress["packets"], egress["bytes"], ingress["packets"], ingress["bytes"])

    def detach(self, sandbox_id: str) -> None:
        """Unplug the sandbox and free its address; a no-op if it is not attached."""
        with self._lock:
            if sandbox_id not in self._sandboxes:
                return
        if os.path.exists(self.namespace_path):
            # On failure this raises and keeps the record, so a retry can finish the job.
            _run(["ip", "-n", self.namespace, "link", "del", sandbox_veth_name(sandbox_id)], ok_if="Cannot find device")
        with self._lock:
            if sandbox_id in self._sandboxes:
                self._release(self._sandboxes.pop(sandbox_id))
            gone = self._loaded.pop(sandbox_id, None)
            if gone is not None:
                self._policy_locks.pop(gone.netns_path, None)

    def attach_peer(self, name: str, netns_path: str, address: str) -> None:
        """Plug another namespace (a test server, an uplink) into the bridge at ``address``.

        Its interface is named ``cp`` + a hash of fabric and peer name, so one
        namespace can join several fabrics; no route or policy is added there.
        """
        netns = _existing_netns(netns_path)
        index = _host_index(address)
        with self._lock:
            self._require_started()
            if name in self._peers:
                raise Conflict(f"peer {name} is already attached to fabric {self.fabric_id}")
            self._claim(index, f"peer {name}")
            self._peers[name] = index
        try:
            inner = _veth_name("cp", f"{self.fabric_id}/{name}")
            self._plug(_veth_name("cx", name), netns, inner, index, as_sandbox=False)
        except BaseException:
            with self._lock:
                self._release(self._peers.pop(name))
            raise

    def adopt(self, sandbox_id: str, address: str) -> None:
        """Re-register a sandbox still plugged in from before an edge restart (no interface changes)."""
        index = _host_index(address)
        with self._lock:
            if self._sandboxes.get(sandbox_id) == index:
                return
            if sandbox_id in self._sandboxes:
                raise Conflict(f"sandbox {sandbox_id} is attached with another address")
            self._claim(index, f"sandbox {sandbox_id}")
            self._sandboxes[sandbox_id] = index

    def address_of(self, sandbox_id: str) -> str | None:
        with self._lock:
            index = self._sandboxes.get(sandbox_id)
        return None if index is None else str(SUBNET.network_address + index)

    def close(self) -> None:
        """Delete the router namespace; every veth goes with it, which unplugs every sandbox."""
        if os.path.exists(self.namespace_path):
            _run(["ip", "netns", "del", self.namespace], ok_if="No such file or directory")
        with self._lock:
            self._reset()

    @staticmethod
    def apply_isolation(netns_path: str) -> None:
        """For sandboxes without network: only loopback; anything else is dropped and counted."""
        _load_policy(_existing_netns(netns_path), _render_policy(()))

    def _plug(self, veth: str, netns: str, inner: str, index: int, *, as_sandbox: bool) -> None:
        """Create a veth pair in the router namespace with its far end already inside ``netns``."""
        proc = _run(
            ["ip", "-n", self.namespace, "-batch", "-"],
            f"link add {veth} master {_BRIDGE} type veth peer name {inner} netns {netns}\n"
            f"link set {veth} addrgenmode none\nlink set {veth} up\n",
            ok_if="File exists",
        )
        if proc.returncode != 0:
            raise Conflict(f"interface {veth} exists in {self.namespace}, or {inner} exists in {netns}: detach first")
        inner_batch = (
            f"link set {inner} addrgenmode none\n"
            f"addr add {SUBNET.network_address + index}/{SUBNET.prefixlen} dev {inner}\nlink set {inner} up\n"
        )
        if as_sandbox:
            inner_batch = f"link set lo up\n{inner_batch}route add default via {GATEWAY}\n"
        try:
            _run(["nsenter", f"--net={netns}", "ip", "-batch", "-"], inner_batch)
        except BaseException:
            with contextlib.suppress(InternalError):
                _run(["ip", "-n", self.namespace, "link", "del", veth])  # takes the far end with it
            raise

    def _require_started(self) -> None:
        if not self._started:
            raise Conflict(f"fabric {self.fabric_id} is not started: call start() first")

    def _allocate(self) -> int:
        while self._freed:
            index = heapq.heappop(self._freed)
            if index not in self._used:
                self._used.add(index)
                return index
        while self._next <= _LAST_HOST:
            index, self._next = self._next, self._next + 1
            if index not in self._used:
                self._used.add(index)
                return index
        raise CapacityExhausted(f"fabric {self.fabric_id} has no free address in {SUBNET}")

    def _claim(self, index: int, owner: str) -> None:
        if index in self._used:
            raise Conflict(f"address {SUBNET.network_address + index} for {owner} is already in use")
        self._used.add(index)

    def _release(self, index: int) -> None:
        self._used.discard(index)
        heapq.heappush(self._freed, index)
