"""The operator's routes: the cluster's nodes and their stats, job tokens, network peers."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from corral.api.models import (
    ClusterNode,
    NodeStats,
)
from corral.gateway.routes.deps import (
    Auth,
    CallerDep,
    Service,
)

__all__ = ["router"]

router = APIRouter()


class NetworkPeer(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,40}$")
    netns_path: str = Field(description="e.g. /proc/<pid>/ns/net of a process in that namespace")
    address: str = Field(description="Its address on the sandbox network, e.g. 10.88.200.2")


class JobToken(BaseModel):
    job: str
    token: str = Field(description="Shown once; use it as the bearer key.")


@router.get("/v1/cluster/nodes", dependencies=[Auth])
async def cluster_nodes(svc: Service) -> list[ClusterNode]:
    """Every node the shared state knows (all gateways' edges): up or lost, last heartbeat, load."""
    return await svc.cluster_nodes()


@router.get("/v1/nodes", dependencies=[Auth])
async def node_stats(svc: Service) -> list[NodeStats]:
    """Per node: sandboxes per backend and state, CPU and memory committed vs used vs reclaimed, pressure."""
    return await svc.node_stats()


@router.post("/v1/jobs/{job}/token", status_code=201)
async def issue_job_token(job: str, caller: CallerDep, request: Request) -> JobToken:
    """A token that reaches only sandboxes labelled job=<job> (a restarted trainer reconnects with it)."""
    caller.require_admin("issue job tokens")
    return JobToken(job=job, token=request.app.state.service.tokens.issue(job))


@router.delete("/v1/jobs/{job}/token")
async def revoke_job_tokens(job: str, caller: CallerDep, request: Request) -> dict[str, int]:
    caller.require_admin("revoke job tokens")
    return {"revoked": request.app.state.service.tokens.revoke(job)}


@router.post("/v1/network/peers", status_code=204)
async def attach_network_peer(body: NetworkPeer, svc: Service, caller: CallerDep) -> Response:
    """Plug a network namespace of this machine (a package mirror, an uplink) into every edge's sandbox
    network at ``address`` (10.88.0.0/16); sandboxes reach it only where their allowlist says so."""
    caller.require_admin("change the sandbox network")
    await svc.attach_network_peer(body.name, body.netns_path, body.address)
    return Response(status_code=204)
