"""E2B's ``Template`` build API through the real SDK: steps built as a Corral Dockerfile build, then a sandbox
created from the template's name."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2b import BuildException, Sandbox, Template


def _name(what: str) -> str:
    return f"e2b-{what}-{time.monotonic_ns()}"


def test_a_built_template_starts_sandboxes(e2b_sandboxes: list, tmp_path: Path) -> None:  # type: ignore[type-arg]
    (tmp_path / "hello.txt").write_text("hello from the build context\n")
    template = (
        Template(file_context_path=str(tmp_path))
        .from_image("debian-12")
        .set_envs({"GREETING": "hi there"})
        .copy("hello.txt", "/opt/app/hello.txt", mode=0o755)
        .set_workdir("/opt/app")
        .run_cmd(["cp hello.txt copied.txt", 'echo "$GREETING from $(pwd)" > env.txt'])
        .run_cmd("id -un > /tmp/who.txt", user="user")  # that step only
        .run_cmd("id -un > /tmp/after.txt")
        .set_user("user")
    )
    name, logs = _name("app"), []
    built = Template.build(template, name, on_build_logs=logs.append)
    assert built.template_id == name
    assert any("RUN cp hello.txt copied.txt" in entry.message for entry in logs)
    assert Template.alias_exists(name)
    sandbox = Sandbox.create(name, allow_internet_access=False)
    e2b_sandboxes.append(sandbox)
    files = "cat /opt/app/copied.txt /opt/app/env.txt /tmp/who.txt /tmp/after.txt; stat -c %a /opt/app/hello.txt"
    assert sandbox.commands.run(files).stdout.splitlines() == [
        "hello from the build context", "hi there from /opt/app", "user", "root", "755",
    ]  # fmt: skip
    assert sandbox.commands.run("echo $GREETING").stdout == "hi there\n"  # the template's env, in the sandbox
    assert sandbox.files.read("/opt/app/hello.txt") == "hello from the build context\n"


def test_a_failing_step_is_a_build_error_with_its_log(tmp_path: Path, e2b_env: dict) -> None:  # type: ignore[type-arg]
    template = Template(file_context_path=str(tmp_path)).from_image("debian-12").run_cmd("echo about to fail; exit 3")
    with pytest.raises(BuildException, match=r"(?s)exit 3.*about to fail"):
        Template.build(template, _name("broken"))
    assert not Template.alias_exists(_name("never-built"))
    starting = Template(file_context_path=str(tmp_path)).from_template("base").set_start_cmd("sleep 9", "true")
    with pytest.raises(BuildException, match="startCmd is not supported"):  # Corral starts nothing in a sandbox
        Template.build(starting, _name("start-cmd"))


def test_build_in_background_and_its_status(e2b_env: dict, tmp_path: Path) -> None:  # type: ignore[type-arg]
    template = Template(file_context_path=str(tmp_path)).from_image("busybox").set_envs({"K": "v"})
    built = Template.build_in_background(template, _name("background"))
    deadline = time.monotonic() + 60
    while (status := Template.get_build_status(built)).status.value in ("waiting", "building"):
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    assert status.status.value == "ready" and status.template_id == built.template_id


def test_upload_links_name_only_template_directories(e2b_env: dict[str, str]) -> None:
    """The template id in the files routes is a template name: one that names another directory is refused."""
    import httpx

    headers = {"X-API-Key": e2b_env["E2B_API_KEY"]}
    files_hash = "0" * 64
    ok = httpx.get(f"{e2b_env['E2B_API_URL']}/templates/some-template/files/{files_hash}", headers=headers)
    assert ok.status_code == 201 and ok.json()["present"] is False and "token=" in ok.json()["url"]
    for bad in ("%2E%2E", ".hidden", "UPPER"):  # %2E%2E: ".." past the client, which would drop it
        refused = httpx.get(f"{e2b_env['E2B_API_URL']}/templates/{bad}/files/{files_hash}", headers=headers)
        assert refused.status_code == 400 and "template id" in refused.json()["message"], (bad, refused.text)
