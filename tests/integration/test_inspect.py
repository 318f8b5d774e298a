"""sandbox="corral" in a real Inspect eval, run by the released inspect-ai with its scripted mock model (issue 20)."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from inspect_ai import Task
from inspect_ai import eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessageTool, ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import bash
from inspect_ai.util import (
    OutputLimitExceededError,
    SandboxUserUnsupportedError,
    override_sandbox_output_limit,
    sandbox,
)

import corral
from corral.embedded import EmbeddedServer
from corral.integrations.inspect import TASK_LABEL, CorralSandboxConfig, CorralSandboxEnvironment
from tests.terminal import LocalTerminal


@scorer(metrics=[accuracy()])
def answer_file() -> object:
    """Reads what the agent's tool call wrote, through the sandbox's read_file."""

    async def score(state: TaskState, target: Target) -> Score:
        written = await sandbox().read_file("answer.txt")
        return Score(value=1.0 if written.strip() == target.text else 0.0, answer=written)

    return score


def test_inspect_eval_runs_its_tools_on_corral(
    server: EmbeddedServer, client: corral.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_URL", server.url)
    monkeypatch.setenv("CORRAL_API_KEY", server.api_key)
    task_name = f"corral_inspect_{uuid.uuid4().hex[:8]}"
    command = "cat input.txt; echo $((6 * 7)) > answer.txt; id -un; pwd; cat /etc/debian_version >/dev/null && echo ok"
    outputs = [ModelOutput.for_tool_call("mockllm/model", "bash", {"command": command}),
               ModelOutput.from_content("mockllm/model", "done")]  # fmt: skip
    for output in outputs:  # given usage, mockllm does not count tokens (tiktoken would fetch its vocabulary)
        output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
    model = get_model("mockllm/model", custom_outputs=outputs)
    sample = Sample(input="Write 6*7 to answer.txt.", target="42", files={"input.txt": "from the sample\n"},
                    setup="echo set up > /tmp/setup-ran")  # fmt: skip
    task = Task(dataset=[sample], solver=[use_tools(bash(timeout=30)), generate()], scorer=answer_file(),
                sandbox="corral", name=task_name)  # fmt: skip

    [log] = inspect_eval(task, model=model, log_dir=str(tmp_path), display="none")

    assert log.status == "success", log.error
    [evaluated] = log.samples or []
    [tool_message] = [m for m in evaluated.messages if isinstance(m, ChatMessageTool)]
    assert tool_message.text.splitlines() == ["from the sample", "root", "/", "ok"]  # files copied, run in debian
    assert evaluated.scores is not None and evaluated.scores["answer_file"].value == 1.0
    [made] = client.list(state=["creating", "running", "paused", "ended", "lost"], labels={TASK_LABEL: task_name})
    assert made.image.startswith("debian-12") and made.state.value == "ended"  # killed at sample cleanup


async def test_sandbox_contract_exec_and_files(
    server: EmbeddedServer, aclient: corral.AsyncClient, tmp_path: Path
) -> None:
    """What Inspect's tools and scorers call, on one sample's sandbox: exec's cwd/env/user/timeout/input and
    its errors, text and binary files, relative paths against the sample's working directory. The config is
    a YAML file, as ``sandbox=("corral", "corral.yaml")`` gives it (Inspect makes the path absolute)."""
    settings = CorralSandboxConfig(image="debian-12", cwd="/work", memory_mb=256, url=server.url,
                                   api_key=server.api_key)  # fmt: skip
    config = str(tmp_path / "corral.yaml")
    Path(config).write_text(yaml.safe_dump(settings.model_dump()))
    await CorralSandboxEnvironment.task_init("contract", config)
    environments = await CorralSandboxEnvironment.sample_init("contract", config, {})
    env = environments["default"]
    try:
        result = await env.exec(["sh", "-c", 'pwd; echo "$GREETING"; id -un'], env={"GREETING": "hi"}, user="nobody")
        assert (result.success, result.stdout.split()) == (True, ["/work", "hi", "nobody"])
        assert (await env.exec(["mkdir", "sub"])).success
        assert (await env.exec(["pwd"], cwd="sub")).stdout == "/work/sub\n"
        assert (await env.exec(["cat"], input="text in")).stdout == "text in"
        binary = bytes(range(256))
        assert (await env.exec(["sh", "-c", "od -An -tx1 | tr -d ' \\n'"], input=binary)).stdout == binary.hex()
        failed = await env.exec(["sh", "-c", "echo oops >&2; exit 3"])
        assert (failed.success, failed.returncode, failed.stderr) == (False, 3, "oops\n")
        with pytest.raises(TimeoutError):
            await env.exec(["sleep", "10"], timeout=1)
        with pytest.raises(SandboxUserUnsupportedError):
            await env.exec(["true"], user="no-such-user")
        with pytest.raises(OutputLimitExceededError), override_sandbox_output_limit(1024):
            await env.exec(["seq", "1", "100000"])

        await env.write_file("notes/a.txt", "line 1\r\nline 2\n")  # parents made, CRLF kept
        assert await env.read_file("/work/notes/a.txt") == "line 1\r\nline 2\n"
        await env.write_file("blob.bin", binary)
        assert await env.read_file("blob.bin", text=False) == binary
        with pytest.raises(OutputLimitExceededError), override_sandbox_output_limit(255, "read_file"):
            await env.read_file("blob.bin", text=False)
        with pytest.raises(FileNotFoundError):
            await env.read_file("missing.txt")
        with pytest.raises(IsADirectoryError):
            await env.read_file("notes")

        connection = await env.connection(user="nobody")
        assert connection.type == "corral" and connection.container == env.as_type(CorralSandboxEnvironment).sandbox.id
        # What a user pastes into their terminal: a shell in the sample's sandbox, as that user, in its workdir.
        shell_env = {**server.env(), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        terminal = LocalTerminal(["/bin/sh", "-c", connection.command], shell_env, rows=24, cols=80)
        try:
            terminal.expect(r"\$ ")
            terminal.type("echo who:$(id -un) in:$PWD; exit 3\r")
            terminal.expect(r"who:nobody in:/work\r\n")
        finally:
            assert terminal.close() == 3
        await aclient.kill(env.as_type(CorralSandboxEnvironment).sandbox.id)
        with pytest.raises(ConnectionError, match="is ended"):
            await env.connection()
    finally:
        await CorralSandboxEnvironment.sample_cleanup("contract", config, environments, False)
    ended = await aclient.get(env.as_type(CorralSandboxEnvironment).sandbox.id)
    assert ended.info.state.value == "ended"
