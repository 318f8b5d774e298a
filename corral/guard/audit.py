"""Audit events: what a sandbox did that a trainer should know about, with a severity.

Events come from the edge (OOM kills, PID-limit hits, denied network packets,
writes to protected paths, killed leftovers) and from detectors over the
commands sent (patterns of known reward hacks and escape attempts). They are
appended to the ``audit_events`` table; every exec and file write is in the
trajectory log already, and the API merges both per sandbox.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from sqlalchemy import JSON, Column, Float, Integer, MetaData, String, Table, insert, select
from sqlalchemy.engine import Engine

__all__ = ["AuditLog", "detect_in_command", "is_protected", "PROTECTED_PREFIXES"]

audit_metadata = MetaData()
audit_events = Table(
    "audit_events",
    audit_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("sandbox_id", String(64), nullable=False, index=True),
    Column("at", Float, nullable=False),
    Column("kind", String(64), nullable=False),
    Column("severity", String(16), nullable=False),  # info | warning | critical
    Column("detail", JSON, nullable=False),
)

# Replacing these is how an agent injects into later shells, the test runner or the grader.
PROTECTED_PREFIXES = (
    "/bin/", "/sbin/", "/usr/bin/", "/usr/sbin/", "/usr/local/bin/", "/lib/", "/lib64/", "/usr/lib/",
    "/etc/ld.so.preload", "/etc/profile", "/etc/bash.bashrc",
)  # fmt: skip

# Commands that try known escapes or reward hacks. A match is evidence to look at, not proof.
_SUSPICIOUS = [
    (re.compile(r"/proc/kpage(cgroup|count|flags)|/proc/kcore|sysrq-trigger"), "probe_kernel_memory", "critical"),
    (re.compile(r"\b(insmod|modprobe|kexec|swapon|mount)\b"), "privileged_tool", "warning"),
    (re.compile(r"\bpip3?\s+install\b[^|;&]*(==|>=|--upgrade|-U\b)"), "package_pin_or_upgrade", "warning"),
    (re.compile(r"\b(nmap|masscan)\b|/dev/tcp/"), "network_probe", "warning"),
    (
        re.compile(r"\b(reward|verifier|grader|expected_output|answers?)\b[^|;&]*>"),
        "writes_reward_like_file",
        "warning",
    ),
    (re.compile(r"\brm\b[^|;&]*\btests?\b|>\s*\S*tests?/"), "modifies_tests", "warning"),
]


def detect_in_command(command: str) -> list[tuple[str, str]]:
    """(kind, severity) of every suspicious pattern in a command."""
    return [(kind, severity) for pattern, kind, severity in _SUSPICIOUS if pattern.search(command)]


def is_protected(path: str, extra: tuple[str, ...] = ()) -> bool:
    return any(path == p.rstrip("/") or path.startswith(p) for p in (*PROTECTED_PREFIXES, *extra))


class AuditLog:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._new = asyncio.Event()
        audit_metadata.create_all(engine)

    def record(self, sandbox_id: str, kind: str, severity: str, detail: dict[str, Any]) -> None:
        with self._engine.begin() as conn:
            conn.execute(
                insert(audit_events).values(
                    sandbox_id=sandbox_id, at=time.time(), kind=kind, severity=severity, detail=detail
                )
            )
        self._new.set()

    def events(
        self, *, sandbox_id: str | None = None, after_id: int = 0, severity: str | None = None, limit: int = 1000
    ) -> list[dict[str, Any]]:
        query = select(audit_events).where(audit_events.c.id > after_id).order_by(audit_events.c.id).limit(limit)
        if sandbox_id is not None:
            query = query.where(audit_events.c.sandbox_id == sandbox_id)
        if severity is not None:
            query = query.where(audit_events.c.severity == severity)
        with self._engine.connect() as conn:
            return [dict(row) for row in conn.execute(query).mappings()]

    async def wait(self, timeout_s: float) -> None:
        """Until a new event is recorded (or the timeout): lets clients follow the events as a stream."""
        self._new.clear()
        try:
            await asyncio.wait_for(self._new.wait(), timeout_s)
        except TimeoutError:
            pass
