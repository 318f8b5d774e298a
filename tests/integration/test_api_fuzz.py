"""Property-based fuzzing of the HTTP API against its own OpenAPI document (schemathesis), bounded in examples.

Every operation gets requests schemathesis derives from docs/openapi.json: reads with valid and invalid input,
writes with invalid input only (a valid one would make sandboxes, builds or pulls at random; what valid writes
do is the rest of the suite's job). "Invalid" includes query parameters a route does not declare, which the
server ignores, so a few such writes do take effect (a sandbox or two, ended with the server). The property:
no answer is a 5xx, none hangs, and the server still serves a sandbox afterwards. The server is this module's
own, on a node dir of its own (layer files hard-linked), so a fuzzed DELETE can remove nothing another test
uses, and nothing leaves loopback. CORRAL_TEST_SLOW=1 runs 25 examples per operation instead of 3.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode

from corral.embedded import EmbeddedServer, linked_node_dir
from tests.conftest import REPO, SLOW_ENV

EXAMPLES_PER_OPERATION = 25 if os.environ.get(SLOW_ENV) == "1" else 3  # ~60 operations: seconds, not minutes
REQUEST_TIMEOUT_S = 30.0  # a hang fails the case instead of the run
UNFUZZED = [  # writes that act on things outside the request even when refused late: left to their own tests
    "/v1/sandboxes/batch", "/v1/sandboxes/bulk", "/v1/sandboxes/{sandbox_id}/fork", "/v1/images/build",
    "/v1/images/pull", "/v1/images/import/{ref}", "/v1/network/peers",
]  # fmt: skip
STREAMS = ["/v1/events", "/v1/audit"]  # reads that follow or wait for minutes: tests/integration/test_events.py


def _schema(modes: list[GenerationMode]) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_path(REPO / "docs" / "openapi.json")
    schema.config.generation.update(modes=modes, max_examples=EXAMPLES_PER_OPERATION, deterministic=True,
                                    database="none")  # fmt: skip
    return schema


reads = _schema([GenerationMode.POSITIVE, GenerationMode.NEGATIVE]).include(method="GET").exclude(path=STREAMS)
writes = _schema([GenerationMode.NEGATIVE]).exclude(method="GET").exclude(path=UNFUZZED)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str]) -> Iterator[EmbeddedServer]:
    node_dir = linked_node_dir(tmp_path_factory.mktemp("fuzz-node"))
    with EmbeddedServer(
        tmp_path_factory.mktemp("fuzz-server"), env={**test_env, "CORRAL_NODE_DIR": str(node_dir)}
    ) as server:
        yield server


def _check(case: schemathesis.Case, server: EmbeddedServer) -> None:
    case.call_and_validate(base_url=server.url, headers={"Authorization": f"Bearer {server.api_key}"},
                           checks=[not_a_server_error], timeout=REQUEST_TIMEOUT_S)  # fmt: skip


@reads.parametrize()
def test_reads_answer_without_server_errors(case: schemathesis.Case, fuzzed: EmbeddedServer) -> None:
    _check(case, fuzzed)


@writes.parametrize()
def test_invalid_writes_are_refused_without_server_errors(case: schemathesis.Case, fuzzed: EmbeddedServer) -> None:
    _check(case, fuzzed)


def test_the_server_still_serves_after_fuzzing(fuzzed: EmbeddedServer) -> None:
    """Runs after the fuzzing above (module order): a sandbox is created, runs a command and goes."""
    with fuzzed.client() as client, client.create("busybox", ttl_s=120) as sandbox:
        assert sandbox.exec("echo still here").stdout == "still here\n"
