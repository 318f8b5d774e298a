"""GET /metrics against a real server, read with prometheus-client's own text parser (issue 21)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

import corral
from corral.embedded import EmbeddedServer

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(server: EmbeddedServer) -> Samples:
    response = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_move_with_a_sandboxs_life(server: EmbeddedServer, client: corral.Client) -> None:
    before = _scrape(server)
    sandbox = client.create("busybox", memory_mb=64, labels={"test": "metrics"})
    try:
        assert sandbox.exec("echo hi").stdout == "hi\n"
        during = _scrape(server)
        sandbox.pause()
        sandbox.resume()
    finally:
        sandbox.kill()
    after = _scrape(server)

    created = ("corral_sandbox_creates_total", {"backend": "container", "outcome": "created"})
    assert _value(after, created[0], **created[1]) == _value(before, created[0], **created[1]) + 1
    histogram = "corral_sandbox_create_duration_seconds_count"
    assert _value(after, histogram, backend="container") == _value(before, histogram, backend="container") + 1
    running = _value(during, "corral_node_sandboxes", edge_id="e0", backend="container", state="running")
    assert running >= 1
    for operation in ("paused", "resumed"):
        name = "corral_sandbox_operations_total"
        assert _value(after, name, operation=operation) == _value(before, name, operation=operation) + 1
    ended = _value(after, "corral_sandboxes_ended_total", reason="killed")
    assert ended == _value(before, "corral_sandboxes_ended_total", reason="killed") + 1

    exec_route = {"method": "POST", "route": "/v1/sandboxes/{sandbox_id}/exec", "code": "200"}
    name = "corral_http_request_duration_seconds_count"
    assert _value(after, name, **exec_route) == _value(before, name, **exec_route) + 1
    assert not any(sandbox.id in dict(labels).get("route", "") for _, labels in after)  # templates, not paths

    committed = _value(during, "corral_node_memory_committed_bytes", edge_id="e0")
    assert committed >= 64 << 20
    assert _value(after, "corral_node_memory_total_bytes", edge_id="e0") > 1 << 30
    assert _value(after, "corral_layer_cache_bytes") > 0 and _value(after, "corral_layer_cache_layers") >= 1
    assert ("corral_node_pressure_avg10_percent", frozenset({("edge_id", "e0"), ("resource", "memory_full")})) in after


def test_the_edge_counts_what_it_does_on_its_own(server: EmbeddedServer, client: corral.Client) -> None:
    """The edge's own registry (edge/metrics.py): its starts, and a resume it did because an exec reached a paused
    sandbox, labelled with its edge_id (on a Ray cluster: tests/cluster/test_cluster_metrics.py)."""
    started = ("corral_edge_sandbox_start_duration_seconds_count", {"edge_id": "e0", "backend": "container"})
    resumed = ("corral_edge_sandbox_operations_total", {"edge_id": "e0", "operation": "resumed"})
    before = _scrape(server)
    with client.create("busybox", memory_mb=64) as sandbox:
        sandbox.pause()
        assert sandbox.exec("echo back").stdout == "back\n"  # the edge resumes it first
        after = _scrape(server)
    assert _value(after, started[0], **started[1]) == _value(before, started[0], **started[1]) + 1
    assert _value(after, resumed[0], **resumed[1]) == _value(before, resumed[0], **resumed[1]) + 1
    bucket = _value(after, "corral_edge_sandbox_start_duration_seconds_bucket", edge_id="e0", backend="container",
                    le="+Inf")  # fmt: skip
    assert bucket == _value(after, started[0], **started[1])


def test_the_edge_counts_how_it_found_each_steps_files(server: EmbeddedServer, client: corral.Client) -> None:
    """A step's files come from the node's change journal (the sandbox's writable layer is in the quota pool); a
    step that leaves a file with a link count its events do not explain (a hard link made, one of two names
    removed) goes to the walk, and the edge's count says which answered."""
    name = "corral_edge_step_files_lookups_total"
    before = _scrape(server)
    with client.create("busybox") as sandbox:
        sandbox.exec("echo a > /one && ln /one /two", step_id="link")
        sandbox.exec("echo b > /three", step_id="write")
        sandbox.exec("rm /two", step_id="unlink")
        steps = {step.step_id: step.files for step in sandbox.trajectory()}
    after = _scrape(server)
    assert steps == {"link": ["/one", "/two"], "write": ["/three"], "unlink": ["/one"]}  # the walk: /two left nothing
    journal = _value(after, name, edge_id="e0", how="journal") - _value(before, name, edge_id="e0", how="journal")
    walk = _value(after, name, edge_id="e0", how="walk") - _value(before, name, edge_id="e0", how="walk")
    assert (journal, walk) == (1, 2)  # write; link and unlink


def test_unmatched_paths_share_one_label(server: EmbeddedServer) -> None:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    for path in ("/no/such/path/1", "/no/such/path/2"):
        assert httpx.get(f"{server.url}{path}", headers=headers).status_code == 404
    samples = _scrape(server)
    routes = {dict(labels).get("route") for name, labels in samples if name.startswith("corral_http_request")}
    assert "unmatched" in routes
    assert not any(route and route.startswith("/no/such") for route in routes)


def test_metrics_need_the_server_key(server: EmbeddedServer, client: corral.Client) -> None:
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    token = client.issue_job_token("metrics-job")
    try:
        response = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {token}"})
        assert response.status_code == 403
        assert "server's API key" in response.json()["error"]["message"]
    finally:
        client.revoke_job_tokens("metrics-job")


def test_fncall_pool_levels_are_reported(server: EmbeddedServer, client: corral.Client) -> None:
    result = client.fncall("echo pooled", image="busybox")
    assert result.stdout == "pooled\n"
    samples = _scrape(server)
    hits_and_misses = [
        value
        for (name, labels), value in samples.items()
        if name in ("corral_fncall_pool_hits_total", "corral_fncall_pool_misses_total")
        and dict(labels).get("image", "").startswith("busybox")
    ]
    assert sum(hits_and_misses) >= 1


def test_the_grafana_dashboard_queries_metrics_the_server_exports(
    server: EmbeddedServer, client: corral.Client
) -> None:
    """docs/grafana/corral.json must not drift from the names /metrics serves (a renamed metric empties a panel)."""
    import json
    import re

    from tests.conftest import REPO

    with client.create("busybox", memory_mb=64) as sandbox:
        sandbox.exec("true")
        client.fncall("true", image="busybox")
        _scrape(server)  # checks status and content type
        text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.api_key}"}).text
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}
    exported = {  # a family with no samples yet (no refusal so far) is still declared
        family.name + suffix for family in text_string_to_metric_families(text) for suffix in suffixes[family.type]
    }
    dashboard = json.loads((REPO / "docs" / "grafana" / "corral.json").read_text())
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried |= set(re.findall(r"\b(corral_[a-z0-9_]+)", target["expr"]))
    assert len(queried) >= 15
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries metrics /metrics does not serve: {missing}"
