"""E2B's egress options (``allow_internet_access``, ``network.allowOut/denyOut``) as Corral's ordered rule list.

E2B's semantics, kept here: an explicit ``allowOut`` entry wins over everything
(Corral also lets it name a private peer, e.g. a package mirror on the sandbox
network); then ``denyOut``; then ``dnsServers``; then, when internet access is
granted (E2B's default), the server's internet policy: public addresses only
(corral/backends/common/network.py ``internet_rules``). With neither internet
nor any rule the sandbox keeps loopback only, as a Corral sandbox does.
``CORRAL_INTERNET_EGRESS=off`` forbids the grant: asked for explicitly it is a
400, left unset it is simply not given.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from corral.api.errors import InvalidRequest
from corral.api.models import NetworkPolicy, NetworkRule
from corral.backends.common.network import AllowRule, internet_rules
from corral.gateway.e2b.common import E2BError, refuse

__all__ = ["InternetEgress", "create_policy", "network_info", "update_policy"]

InternetEgress = Literal["public", "off"]

_EGRESS_FIELDS = {"allowOut", "denyOut", "dnsServers"}
_REFUSED = {
    "egressProxy": "no SOCKS5 tunnelling: plug an uplink into the sandbox network instead (POST /v1/network/peers)",
    "rules": "no per-host HTTP transforms: Corral filters packets by address, it does not proxy requests",
    "maskRequestHost": "sandbox URLs are this server's URL with E2b-Sandbox-Id headers",
    "httpsPorts": "the facade serves envd and the code interpreter only, not the sandbox's own ports",
}


def _internet(asked: Any, egress: InternetEgress) -> bool:
    if asked is not None and not isinstance(asked, bool):
        raise E2BError(400, f"allow_internet_access must be true or false, not {asked!r}")
    if egress == "off":
        if asked:
            raise E2BError(
                400,
                "allow_internet_access=True is refused: this server gives sandboxes no internet "
                "(CORRAL_INTERNET_EGRESS=off); pass allow_internet_access=False, and name what a sandbox may reach "
                "in network={'allow_out': [...]}",
            )
        return False
    return asked is not False  # E2B's default is on


def _entries(network: dict[str, Any], field: str) -> list[str]:
    value = network.get(field)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise E2BError(400, f"network.{field} must be a list of addresses, CIDRs or host names, not {value!r}")
    return value


def _rule(entry: str, action: Literal["allow", "deny"]) -> NetworkRule:
    """An address, a CIDR or a host name (all ports, any protocol); validated as the fabric will."""
    if entry.startswith("*."):
        raise refuse(f"wildcard host {entry!r}", "rules match addresses, and a wildcard names none: list the hosts")
    try:
        cidr: str | None = str(ipaddress.ip_network(entry, strict=False))
    except ValueError:
        cidr = None
    rule = NetworkRule(cidr=cidr, host=None if cidr else entry, protocol="any", action=action)
    try:
        AllowRule(cidr=rule.cidr, host=rule.host, protocol="any", action=action)
    except InvalidRequest as exc:
        raise E2BError(400, f"network entry {entry!r}: {exc.message}") from None
    return rule


def _rules(network: dict[str, Any], internet: bool) -> list[NetworkRule]:
    for field, why in _REFUSED.items():
        if network.get(field) not in (None, {}, []):
            raise refuse(f"network.{field}", why)
    rules = [_rule(entry, "allow") for entry in _entries(network, "allowOut")]
    for server in _entries(network, "dnsServers"):
        try:
            address = ipaddress.IPv4Address(server)
        except ValueError:
            raise E2BError(400, f"network.dnsServers entry {server!r} is not an IPv4 address") from None
        rules += [NetworkRule(cidr=f"{address}/32", ports=[53], protocol=proto) for proto in ("udp", "tcp")]
    rules += [_rule(entry, "deny") for entry in _entries(network, "denyOut")]
    if internet:
        rules += [
            NetworkRule(cidr=r.cidr, ports=list(r.ports), protocol=r.protocol, action=r.action)
            for r in internet_rules()
        ]
    return rules


def create_policy(body: dict[str, Any], egress: InternetEgress) -> NetworkPolicy | None:
    """The create body's egress as a Corral policy; None (loopback only) when it allows nothing."""
    network = body.get("network") or {}
    if not isinstance(network, dict):
        raise E2BError(400, "network must be an object")
    unknown = sorted(set(network) - _EGRESS_FIELDS - set(_REFUSED) - {"allowPublicTraffic"})
    if unknown:
        raise refuse(f"network option(s) {', '.join(unknown)}", "unknown to this facade")
    # allowPublicTraffic is E2B's default (True: e2b 2.45 sends it with every network=): accepted, and every
    # request to the sandbox still needs its access token, the stricter of the two (docs/e2b.md).
    rules = _rules(network, _internet(body.get("allow_internet_access"), egress))
    return NetworkPolicy(allow=rules) if rules else None


def update_policy(body: dict[str, Any], egress: InternetEgress) -> NetworkPolicy:
    """``PUT /sandboxes/{id}/network``: the whole egress configuration, replaced at once (omitted fields
    return to their defaults, as on E2B: internet on unless the server forbids it)."""
    unknown = sorted(set(body) - _EGRESS_FIELDS - set(_REFUSED) - {"allow_internet_access"})
    if unknown:
        raise refuse(f"network option(s) {', '.join(unknown)}", "unknown to this facade")
    return NetworkPolicy(allow=_rules(body, _internet(body.get("allow_internet_access"), egress)))


def _entry(rule: NetworkRule) -> str:
    """A rule as the allowOut/denyOut entry it came from: a host name, an address, or a CIDR."""
    if rule.host is not None:
        return rule.host
    network = ipaddress.ip_network(rule.cidr or "", strict=False)
    return str(network.network_address) if network.prefixlen == network.max_prefixlen else str(network)


def network_info(policy: NetworkPolicy | None) -> tuple[bool, dict[str, Any]]:
    """``get_info``'s ``allowInternetAccess`` and ``network``, read back from the rules as loaded (what the create
    or the last ``update_network`` configured; ``_rules`` in reverse)."""
    rules = list(policy.allow) if policy is not None else []
    grant = [
        NetworkRule(cidr=r.cidr, ports=list(r.ports), protocol=r.protocol, action=r.action) for r in internet_rules()
    ]
    internet = len(rules) >= len(grant) and rules[len(rules) - len(grant) :] == grant
    if internet:
        rules = rules[: len(rules) - len(grant)]
    network: dict[str, list[str]] = {"allowOut": [], "denyOut": [], "dnsServers": []}
    for rule in rules:
        if rule.ports == [53] and rule.protocol in ("udp", "tcp"):
            if rule.protocol == "udp":
                network["dnsServers"].append(_entry(rule))
        else:
            network["allowOut" if rule.action == "allow" else "denyOut"].append(_entry(rule))
    return internet, {"allowPublicTraffic": False, **{k: v for k, v in network.items() if v}}
