"""e2b-code-interpreter's run_code and contexts against Corral, sync and async, with real sandboxes."""

from __future__ import annotations

import time

import pytest
from e2b import TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox


@pytest.fixture
def code_sbx(e2b_sandboxes: list) -> Sandbox:  # type: ignore[type-arg]
    sandbox = Sandbox.create(timeout=300)  # the default template: code-interpreter-v1
    e2b_sandboxes.append(sandbox)
    return sandbox


def test_run_code_streams_output_results_and_errors(code_sbx: Sandbox) -> None:
    stdout: list[str] = []
    execution = code_sbx.run_code(
        "import sys, time\nfor i in range(3):\n    print(i); time.sleep(0.1)\nprint('warn', file=sys.stderr)\n6 * 7",
        on_stdout=lambda m: stdout.append(m.line),
    )
    assert execution.error is None
    assert "".join(execution.logs.stdout) == "0\n1\n2\n" and execution.logs.stderr == ["warn\n"]
    assert len(stdout) == 3
    assert execution.text == "42" and execution.results[0].is_main_result
    failed = code_sbx.run_code("1 / 0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert "division by zero" in failed.error.value and "Traceback" in failed.error.traceback
    assert failed.execution_count is not None and failed.execution_count > execution.execution_count


def test_state_is_kept_between_calls_and_contexts_are_separate(code_sbx: Sandbox) -> None:
    code_sbx.run_code("x = 40")
    assert code_sbx.run_code("x + 2").text == "42"
    context = code_sbx.create_code_context(cwd="/tmp")
    assert code_sbx.run_code("import os; os.getcwd()", context=context).text == "'/tmp'"
    missing = code_sbx.run_code("x", context=context)
    assert missing.error is not None and missing.error.name == "NameError"
    code_sbx.run_code("y = 1", context=context)
    assert context.id in [c.id for c in code_sbx.list_code_contexts()]
    code_sbx.restart_code_context(context)
    assert code_sbx.run_code("'y' in globals()", context=context).text == "False"
    code_sbx.remove_code_context(context)
    assert context.id not in [c.id for c in code_sbx.list_code_contexts()]
    assert code_sbx.run_code("x", envs={"K": "v"}).text == "40"
    assert code_sbx.run_code("import os; os.environ.get('K')", envs={"K": "v"}).text == "'v'"
    assert code_sbx.run_code("import os; os.environ.get('K')").text is None  # env vars last one call


def test_cells_are_commands_of_the_sandbox(code_sbx: Sandbox) -> None:
    code_sbx.run_code("open('/home/user/from_cell.txt', 'w').write('cell')")
    assert code_sbx.files.read("/home/user/from_cell.txt") == "cell"
    assert code_sbx.run_code("import getpass; getpass.getuser()").text == "'user'"
    child = code_sbx.run_code("import subprocess; subprocess.run('echo out; echo err >&2', shell=True)")
    assert child.logs.stdout == ["out\n"] and child.logs.stderr == ["err\n"]


def test_a_timed_out_cell_leaves_the_context_usable(code_sbx: Sandbox) -> None:
    code_sbx.run_code("kept = 'yes'")
    started = time.monotonic()
    with pytest.raises(TimeoutException, match="timed out"):
        code_sbx.run_code("import time; time.sleep(3)", timeout=1)
    assert time.monotonic() - started < 3
    # The SDK may keep its connection open after its timeout: the cell then runs on and this one waits for it.
    assert code_sbx.run_code("kept").text == "'yes'"


def test_other_languages_are_refused(code_sbx: Sandbox) -> None:
    with pytest.raises(Exception, match="Python only"):
        code_sbx.run_code("console.log(1)", language="js")


async def test_async_run_code(e2b_env: dict[str, str]) -> None:
    sandbox = await AsyncSandbox.create(timeout=300)
    try:
        lines: list[str] = []
        execution = await sandbox.run_code("print('a'); print('b'); 'done'", on_stdout=lambda m: lines.append(m.line))
        assert execution.text == "'done'" and lines == ["a\n", "b\n"]
        context = await sandbox.create_code_context()
        await sandbox.run_code("z = 5", context=context)
        assert (await sandbox.run_code("z * 2", context=context)).text == "10"
    finally:
        await sandbox.kill()
