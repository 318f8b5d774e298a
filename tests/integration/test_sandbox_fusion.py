"""SandboxFusion's API on Corral, driven by the released ``sandbox-fusion`` client (what verl's tools call).

Every call runs in the session server's fncall pools. C, C++, Java, Go and Node.js need the toolchain
image: setup.sh builds it on a node (CORRAL_SETUP_TOOLCHAINS); where it is missing, the ``toolchains``
fixture has the server build it on first use, once per session (minutes).
"""

from __future__ import annotations

import base64
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sandbox_fusion import (
    CommandRunStatus,
    RunCodeRequest,
    RunJupyterRequest,
    RunStatus,
    SummaryMapping,
    run_code,
    run_jupyter,
    summary_run_code_result,
)

from corral.embedded import EmbeddedServer, linked_node_dir
from corral.gateway.sandbox_fusion import BUILDING, sandbox_fusion_key

_BUILD_TIMEOUT_S = 1800.0

HELLO = {
    "python": 'print("hello from python")',
    "bash": 'echo "hello from bash"',
    "nodejs": 'console.log("hello from nodejs")',
    "cpp": '#include <iostream>\nint main() { std::cout << "hello from cpp" << std::endl; }\n',
    "java": 'public class Main { public static void main(String[] a) { System.out.println("hello from java"); } }\n',
    "go": 'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("hello from go") }\n',
}
COMPILED = {"cpp", "java", "go"}
# The first test that needs the toolchain image waits for its build when setup.sh did not make it (minutes).
needs_toolchains = pytest.mark.timeout(_BUILD_TIMEOUT_S + 60)


@pytest.fixture(scope="module")
def endpoint(server: EmbeddedServer) -> str:
    return f"{server.url}/sandbox-fusion/{sandbox_fusion_key(server.api_key)}"


def _once_built(endpoint: str, call: dict[str, object], poll_s: float) -> dict[str, Any]:
    """The answer to ``call`` once the image it needs is there (its first use starts the build)."""
    deadline = time.monotonic() + _BUILD_TIMEOUT_S
    while True:
        answer: dict[str, Any] = httpx.post(f"{endpoint}/run_code", json=call, timeout=120).json()
        if answer["status"] != "SandboxError" or not answer["message"].startswith(BUILDING):
            return answer
        assert time.monotonic() < deadline, f"not built in time: {answer['message']}"
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def toolchains(endpoint: str) -> Iterator[None]:
    """The toolchain image is there (setup.sh builds it; else this server does, once, in minutes)."""
    answer = _once_built(endpoint, {"language": "c", "code": "int main(void) { return 0; }"}, poll_s=5)
    assert answer["status"] == "Success", answer
    yield


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@needs_toolchains
@pytest.mark.parametrize("language", list(HELLO))
def test_hello_world(endpoint: str, language: str, request: pytest.FixtureRequest) -> None:
    if language not in ("python", "bash"):
        request.getfixturevalue("toolchains")
    result = run_code(RunCodeRequest(code=HELLO[language], language=language), endpoint=endpoint)
    assert result.status == RunStatus.Success, result
    assert result.run_result is not None and result.run_result.status == CommandRunStatus.Finished
    assert result.run_result.return_code == 0
    assert result.run_result.stdout == f"hello from {language}\n"
    assert result.run_result.execution_time is not None and result.run_result.execution_time < 10
    assert (result.compile_result is not None) == (language in COMPILED)
    if result.compile_result is not None:
        assert result.compile_result.return_code == 0
    assert result.executor_pod_name  # the sandbox that ran it


@needs_toolchains
def test_c_is_served_too(endpoint: str, toolchains: None) -> None:
    """C is not in the client's list of languages (SandboxFusion has none): a plain request runs it."""
    code = '#include <stdio.h>\n#include <math.h>\nint main(void) { printf("%.1f\\n", sqrt(2.25)); return 3; }\n'
    answer = httpx.post(f"{endpoint}/run_code", json={"language": "c", "code": code}, timeout=60).json()
    assert answer["status"] == "Failed"  # a non-zero exit is a failed run
    assert answer["compile_result"]["return_code"] == 0
    assert answer["run_result"]["stdout"] == "1.5\n" and answer["run_result"]["return_code"] == 3


@needs_toolchains
def test_compile_error_stops_before_the_run(endpoint: str, toolchains: None) -> None:
    result = run_code(RunCodeRequest(code="int main() { return undeclared; }\n", language="cpp"), endpoint=endpoint)
    assert result.status == RunStatus.Failed
    assert result.compile_result is not None and result.compile_result.status == CommandRunStatus.Finished
    assert result.compile_result.return_code != 0 and "undeclared" in (result.compile_result.stderr or "")
    assert result.run_result is None
    assert summary_run_code_result(result, SummaryMapping(CompileFailed="CE")) == "CE"


def test_run_timeout(endpoint: str) -> None:
    started = time.monotonic()
    result = run_code(RunCodeRequest(code="while True: pass", language="python", run_timeout=1), endpoint=endpoint)
    assert result.status == RunStatus.Failed
    assert result.run_result is not None and result.run_result.status == CommandRunStatus.TimeLimitExceeded
    assert result.run_result.return_code is None
    assert 0.9 < (result.run_result.execution_time or 0) < 5 and time.monotonic() - started < 10
    assert summary_run_code_result(result, SummaryMapping(RunTimeout="TLE")) == "TLE"


def test_stdin_and_args(endpoint: str) -> None:
    code = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()), sys.argv[1:])"
    answer = httpx.post(
        f"{endpoint}/run_code",
        json={"language": "python", "code": code, "stdin": "1 2 3\n4", "args": ["-v", "x y"]},
        timeout=60,
    ).json()
    assert answer["status"] == "Success", answer
    assert answer["run_result"]["stdout"] == "10 ['-v', 'x y']\n"


def test_code_too_long_for_the_command_line_runs_from_a_file(endpoint: str) -> None:
    code = "#" + "x" * (200 << 10) + "\nprint(__file__)"  # past one argument's 128 KiB limit
    result = run_code(RunCodeRequest(code=code, language="python"), endpoint=endpoint)
    assert result.status == RunStatus.Success and result.run_result is not None
    assert result.run_result.stdout == "/tmp/main.py\n"


@needs_toolchains
def test_stdin_of_a_compiled_program(endpoint: str, toolchains: None) -> None:
    code = "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a * b << '\\n'; }\n"
    result = run_code(RunCodeRequest(code=code, language="cpp", stdin="6 7\n"), endpoint=endpoint)
    assert result.status == RunStatus.Success and result.run_result is not None
    assert result.run_result.stdout == "42\n"


def test_files_in_and_out(endpoint: str) -> None:
    code = (
        "import pathlib\n"
        "numbers = pathlib.Path('data/in.txt').read_text().split()\n"
        "pathlib.Path('out.txt').write_text(str(sum(map(int, numbers))))\n"
        "print(open('/tmp/abs.txt').read())\n"
    )
    files = {"data/in.txt": _b64("3 4 5"), "/tmp/abs.txt": _b64("absolute"), "skipped.txt": None}
    result = run_code(
        RunCodeRequest(code=code, language="python", files=files, fetch_files=["out.txt", "missing.txt", "data"]),
        endpoint=endpoint,
    )
    assert result.status == RunStatus.Success, result
    assert result.run_result is not None and result.run_result.stdout == "absolute\n"
    assert {name: base64.b64decode(data).decode() for name, data in result.files.items()} == {"out.txt": "12"}


def test_memory_limit(endpoint: str) -> None:
    code = "blocks = [bytearray(32 << 20) for _ in range(16)]\nprint('allocated')"
    answer = httpx.post(
        f"{endpoint}/run_code", json={"language": "python", "code": code, "memory_limit_MB": 128}, timeout=60
    ).json()
    assert answer["status"] == "Failed", answer
    assert answer["run_result"]["return_code"] != 0 and "allocated" not in answer["run_result"]["stdout"]


def test_run_jupyter_cells_share_one_kernel(endpoint: str) -> None:
    cells = ["a = 123", "a", "print(a)", 'import sys; sys.stderr.write("stderr message")', 'raise RuntimeError("boom")']
    result = run_jupyter(RunJupyterRequest(cells=cells), endpoint=endpoint)
    assert result.status == RunStatus.Success, result
    assert result.driver is not None and result.driver.status == CommandRunStatus.Finished
    assert len(result.cells) == 5
    assert result.cells[1].display == [{"text/plain": "123"}]
    assert result.cells[2].stdout == "123\n"
    assert result.cells[3].stderr == "stderr message"
    assert result.cells[3].display == [{"text/plain": "14"}]  # write() returned the length, the cell's value
    (error,) = result.cells[4].error
    assert error["ename"] == "RuntimeError" and error["evalue"] == "boom"
    assert any("RuntimeError: boom" in line for line in error["traceback"])


def test_run_jupyter_timeouts_and_files(endpoint: str) -> None:
    cells = ["import time; time.sleep(30)", "print(open('in.txt').read()); open('out.txt', 'w').write('done')"]
    request = RunJupyterRequest(cells=cells, cell_timeout=1, files={"in.txt": _b64("given")}, fetch_files=["out.txt"])
    result = run_jupyter(request, endpoint=endpoint)
    assert result.status == RunStatus.Success, result
    (error,) = result.cells[0].error
    assert error["ename"] == "TimeoutError"
    assert result.cells[1].stdout == "given\n" and base64.b64decode(result.files["out.txt"]) == b"done"
    over = run_jupyter(RunJupyterRequest(cells=["while True: pass"], total_timeout=1), endpoint=endpoint)
    assert over.status == RunStatus.Failed and over.cells == []
    assert over.driver is not None and over.driver.status == CommandRunStatus.TimeLimitExceeded


def test_authentication(server: EmbeddedServer, endpoint: str) -> None:
    call = {"language": "bash", "code": "echo hi"}
    assert httpx.post(f"{server.url}/run_code", json=call).status_code == 401  # the root route wants a key
    wrong = httpx.post(f"{server.url}/sandbox-fusion/sf_{'0' * 40}/run_jupyter", json={"cells": ["1"]})
    assert wrong.status_code == 401
    with_key = httpx.post(f"{server.url}/run_code", json=call, headers={"Authorization": f"Bearer {server.api_key}"})
    assert with_key.status_code == 200 and with_key.json()["run_result"]["stdout"] == "hi\n"
    unknown = httpx.post(f"{endpoint}/run_code", json={"language": "rust", "code": "fn main() {}"})
    assert unknown.status_code in (400, 422) and "language" in unknown.text


@needs_toolchains
def test_the_cli_prints_the_endpoint_and_waits_for_the_toolchains(
    server: EmbeddedServer, endpoint: str, toolchains: None
) -> None:
    done = subprocess.run([sys.executable, "-m", "corral.cli.main", "sandbox-fusion", "--build"], env=server.env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"export SANDBOX_FUSION_ENDPOINT={endpoint}\n" in done.stdout
    assert f"sandbox_fusion_url: {endpoint}/run_code" in done.stdout and "toolchain image is ready" in done.stdout


def test_a_missing_image_is_built_on_first_use(tmp_path: Path, test_env: dict[str, str]) -> None:
    """A node without the image builds it on the first call that needs it, and answers SandboxError meanwhile.
    The image here is busybox (CORRAL_SANDBOX_FUSION_IMAGE), built in a second: debian-12-toolchains is built
    the same way, in minutes. This server also has CORRAL_SANDBOX_FUSION_OPEN: the root routes take no key."""
    node_dir = linked_node_dir(tmp_path / "node", parts=("bin",))  # no layers at all
    env = {**test_env, "CORRAL_NODE_DIR": str(node_dir), "CORRAL_SANDBOX_FUSION_IMAGE": "busybox",
           "CORRAL_SANDBOX_FUSION_OPEN": "true"}  # fmt: skip
    with EmbeddedServer(tmp_path / "server", env=env) as server:
        endpoint = server.url  # open: SandboxFusion's own paths, no key
        call = {"language": "nodejs", "code": "console.log(1)"}
        first = httpx.post(f"{endpoint}/run_code", json=call, timeout=60).json()
        assert first["status"] == "SandboxError" and first["message"].startswith(f"{BUILDING} busybox"), first
        answer = _once_built(endpoint, call, poll_s=0.5)
        assert answer["status"] == "Failed" and answer["run_result"]["return_code"] == 127  # busybox has no node
        assert "busybox" in {
            image["name"].split(":")[0]
            for image in httpx.get(
                f"{server.url}/v1/images", headers={"Authorization": f"Bearer {server.api_key}"}
            ).json()
        }
