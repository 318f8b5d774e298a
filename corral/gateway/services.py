"""The services the HTTP layer talks to, one object on ``app.state.service`` (made by corral/server.py)."""

from __future__ import annotations

from dataclasses import dataclass

from corral.gateway.auth import JobTokens
from corral.gateway.fncall import FnCallService
from corral.gateway.grading import Grader
from corral.gateway.images import ImageService
from corral.gateway.operations import Operations
from corral.gateway.service import SandboxService
from corral.gateway.trajectory import Trajectories

__all__ = ["Services"]


@dataclass(frozen=True)
class Services:
    sandboxes: SandboxService
    images: ImageService
    operations: Operations
    trajectories: Trajectories
    tokens: JobTokens
    fncall: FnCallService
    grader: Grader
