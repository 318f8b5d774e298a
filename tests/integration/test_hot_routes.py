"""The hot routes (exec, fncall, create: gateway/hot_routes.py) answer every kind of request as their declared FastAPI
routes did: each branch of the dispatch (the caller refused, a job token on another job's sandbox, a body that does
not parse or match, an error of the operation, success) and a method the route does not declare."""

from __future__ import annotations

import json

import httpx

import corral
from corral.embedded import EmbeddedServer

UNKNOWN = "sb-e0-0000000000000000"


def test_exec_answers_every_kind_of_request_as_the_api_does(server: EmbeddedServer, client: corral.Client) -> None:
    key = {"Authorization": f"Bearer {server.api_key}"}
    token = client.issue_job_token("hot-routes")
    with client.create("busybox", labels={"job": "other"}) as outsider, httpx.Client(base_url=server.url) as http:
        url = f"/v1/sandboxes/{outsider.id}/exec"
        cases = {
            "no key": http.post(url, json={"cmd": "true"}),
            "wrong key": http.post(url, json={"cmd": "true"}, headers={"Authorization": "Bearer ck_wrong"}),
            "not bearer": http.post(url, json={"cmd": "true"}, headers={"Authorization": f"Basic {server.api_key}"}),
            "another job's": http.post(url, json={"cmd": "true"}, headers={"Authorization": f"Bearer {token}"}),
            "not json": http.post(url, content=b"{not json", headers=key),
            "cmd of a wrong type": http.post(url, json={"cmd": 5}, headers=key),
            "unknown sandbox": http.post(f"/v1/sandboxes/{UNKNOWN}/exec", json={"cmd": "true"}, headers=key),
            "not a sandbox id": http.post("/v1/sandboxes/garbage/exec", json={"cmd": "true"}, headers=key),
        }
        answers = {
            name: (r.status_code, r.headers["content-type"], r.json()["error"]["code"]) for name, r in cases.items()
        }
        json_type = "application/json"
        assert answers == {
            "no key": (401, json_type, "unauthenticated"),
            "wrong key": (401, json_type, "unauthenticated"),
            "not bearer": (401, json_type, "unauthenticated"),
            "another job's": (403, json_type, "permission_denied"),
            "not json": (400, json_type, "invalid_request"),
            "cmd of a wrong type": (400, json_type, "invalid_request"),
            "unknown sandbox": (404, json_type, "not_found"),
            "not a sandbox id": (404, json_type, "not_found"),
        }
        assert cases["cmd of a wrong type"].json()["error"]["message"].startswith("invalid request: cmd")
        assert "look like" in cases["not a sandbox id"].json()["error"]["message"]

        done = http.post(url, json={"cmd": "echo hot; exit 3", "env": {"A": "1"}}, headers=key)
        assert done.status_code == 200 and done.headers["content-type"] == json_type
        assert (done.json()["exit_code"], done.json()["stdout"]) == (3, "hot\n")
        assert http.get(url, headers=key).status_code == 405  # not declared: FastAPI's router answers
        outsider.kill()
        gone = http.post(url, json={"cmd": "true"}, headers=key)
        assert (gone.status_code, gone.json()["error"]["code"]) == (410, "sandbox_gone")
    client.revoke_job_tokens("hot-routes")


def test_a_job_token_reaches_its_own_sandbox_through_the_hot_route(
    server: EmbeddedServer, client: corral.Client
) -> None:
    token = client.issue_job_token("hot-routes-own")
    try:
        with corral.Client(server.url, token) as trainer, trainer.create("busybox") as mine:
            assert mine.exec("echo mine").stdout == "mine\n"
            assert trainer.fncall("echo call").stdout == "call\n"
    finally:
        client.revoke_job_tokens("hot-routes-own")


def test_create_answers_every_kind_of_request_as_the_api_does(server: EmbeddedServer, client: corral.Client) -> None:
    """A create reads its body as FastAPI reads a body model: JSON only under a JSON media type, an empty body
    missing; the caller's labels checked; the record written with the route's status code, 201."""
    key = {"Authorization": f"Bearer {server.api_key}"}
    token = client.issue_job_token("hot-create")
    as_job = {"Authorization": f"Bearer {token}"}
    body = {"image": "busybox", "labels": {"case": "hot-create"}}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            cases = {
                "no key": http.post("/v1/sandboxes", json=body),
                "wrong key": http.post("/v1/sandboxes", json=body, headers={"Authorization": "Bearer ck_wrong"}),
                "another job's label": http.post(
                    "/v1/sandboxes", json={**body, "labels": {"job": "other"}}, headers=as_job
                ),
                "not json": http.post("/v1/sandboxes", content=b"{not json", headers=key),
                "empty": http.post("/v1/sandboxes", content=b"", headers=key),
                "json as text/plain": http.post(
                    "/v1/sandboxes", content=json.dumps(body), headers={**key, "content-type": "text/plain"}
                ),
                "memory of a wrong type": http.post("/v1/sandboxes", json={**body, "memory_mb": "lots"}, headers=key),
                "unknown field": http.post("/v1/sandboxes", json={**body, "colour": "red"}, headers=key),
                "unknown image": http.post("/v1/sandboxes", json={"image": "no-such-image:1"}, headers=key),
            }
            answers = {name: (r.status_code, r.json()["error"]["code"]) for name, r in cases.items()}
            assert answers == {
                "no key": (401, "unauthenticated"),
                "wrong key": (401, "unauthenticated"),
                "another job's label": (403, "permission_denied"),
                "not json": (400, "invalid_request"),
                "empty": (400, "invalid_request"),
                "json as text/plain": (400, "invalid_request"),
                "memory of a wrong type": (400, "invalid_request"),
                "unknown field": (400, "invalid_request"),
                "unknown image": (404, "not_found"),
            }
            assert cases["empty"].json()["error"]["message"] == "invalid request: body: Field required"
            assert cases["memory of a wrong type"].json()["error"]["message"].startswith("invalid request: memory_mb")
            assert "valid dictionary" in cases["json as text/plain"].json()["error"]["message"]
            assert http.put("/v1/sandboxes", json=body, headers=key).status_code == 405  # FastAPI's router answers

            made = http.post(
                "/v1/sandboxes",
                content=json.dumps(body),
                headers={**key, "content-type": "application/json; charset=utf-8"},
            )
            assert (made.status_code, made.headers["content-type"]) == (201, "application/json")
            info = made.json()
            assert info == http.get(f"/v1/sandboxes/{info['id']}", headers=key).json()
            assert (info["state"], info["labels"]) == ("running", {"case": "hot-create"})

            mine = http.post("/v1/sandboxes", json=body, headers=as_job)  # a job token's job label is forced
            assert (mine.status_code, mine.json()["labels"]) == (201, {"case": "hot-create", "job": "hot-create"})
            for made_id in (info["id"], mine.json()["id"]):
                assert http.delete(f"/v1/sandboxes/{made_id}", headers=key).status_code == 200
    finally:
        client.revoke_job_tokens("hot-create")
