"""Who is calling: the server's API key (everything), or a job token (one job's sandboxes).

A job token lets a restarted trainer reconnect to its own sandboxes, and only
those: it sees and acts on sandboxes labelled ``job=<job>``, creates
sandboxes with that label, and can read (not change) images. Tokens are
stored as sha256 digests; the token itself is shown once, when issued.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import delete, insert, select
from sqlalchemy.engine import Engine

from corral.api.errors import AuthenticationError, InvalidRequest, PermissionDenied
from corral.state.db import job_tokens
from corral.state.records import JOB_LABEL

__all__ = ["Caller", "JobTokens", "JOB_LABEL"]

_JOB_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_OWNERS_KEPT = 100_000  # sandboxes whose owning job is remembered (~150 bytes each)


@dataclass(frozen=True)
class Caller:
    job: str | None  # None: the API key, no restriction

    def check_labels(self, labels: dict[str, str]) -> dict[str, str]:
        """The labels a sandbox created by this caller gets (a job token's job label is forced)."""
        if self.job is None:
            return labels
        if labels.get(JOB_LABEL, self.job) != self.job:
            raise PermissionDenied(f"a token of job {self.job!r} cannot create sandboxes of job {labels[JOB_LABEL]!r}")
        return {**labels, JOB_LABEL: self.job}

    def check_owner(self, sandbox_id: str, labels: dict[str, str]) -> None:
        if self.job is not None and labels.get(JOB_LABEL) != self.job:
            raise PermissionDenied(f"sandbox {sandbox_id} does not belong to job {self.job!r}")

    def require_admin(self, what: str) -> None:
        if self.job is not None:
            raise PermissionDenied(f"a job token cannot {what}: use the server's API key")


class JobTokens:
    def __init__(self, engine: Engine, api_key: str) -> None:
        self._engine = engine
        self._api_key = api_key.encode()
        self._jobs: dict[str, str] = {}  # token sha256 -> job, filled as tokens are seen
        self._owners: dict[str, str] = {}  # sandbox id -> the job a token of which was found to own it

    @property
    def server_key(self) -> str:
        """The server's API key (the E2B facade derives its keys from it)."""
        return self._api_key.decode()

    def issue(self, job: str) -> str:
        if not _JOB_RE.match(job):
            raise InvalidRequest(f"job name {job!r} must be 1-128 of letters, digits and ._:-")
        token = f"cj_{secrets.token_hex(24)}"
        with self._engine.begin() as conn:
            conn.execute(insert(job_tokens).values(token_sha256=_digest(token), job=job, created_at=time.time()))
        return token

    def revoke(self, job: str) -> int:
        with self._engine.begin() as conn:
            removed = conn.execute(delete(job_tokens).where(job_tokens.c.job == job)).rowcount
        self._jobs = {digest: name for digest, name in self._jobs.items() if name != job}
        self._owners = {sandbox_id: name for sandbox_id, name in self._owners.items() if name != job}
        return int(removed)

    def known_owner(self, sandbox_id: str, job: str) -> bool:
        """Whether a token of ``job`` was already found to own the sandbox. Only owners are remembered, and a
        sandbox's job label never changes once a client has its id (a warm pool's claim sets it before the id
        is handed out), so this never lets in a caller its record would refuse. Without it a job token's
        every request read the record: +1.0 ms an exec on PostgreSQL (docs/spec.md)."""
        return self._owners.get(sandbox_id) == job

    def remember_owner(self, sandbox_id: str, job: str) -> None:
        if len(self._owners) >= _OWNERS_KEPT:
            self._owners.clear()  # read again when next asked: bounded memory, at worst a read a sandbox
        self._owners[sandbox_id] = job

    def caller(self, credential: str | None) -> Caller:
        if credential is None:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>' (see CORRAL_API_KEY)")
        if hmac.compare_digest(credential.encode(), self._api_key):
            return Caller(job=None)
        digest = _digest(credential)
        job = self._jobs.get(digest)
        if job is None:
            with self._engine.connect() as conn:
                row = conn.execute(select(job_tokens.c.job).where(job_tokens.c.token_sha256 == digest)).first()
            if row is None:
                raise AuthenticationError("wrong API key or job token (revoked?): check CORRAL_API_KEY")
            job = self._jobs[digest] = row.job
        return Caller(job=job)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
