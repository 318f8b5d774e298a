"""Run by tests/e2b/test_e2b_old_sdk.py with an older e2b first on sys.path: a whole session, printed as JSON."""

import json
import sys

import e2b
from e2b import Sandbox

report = {"version": e2b.__file__}
sandbox = Sandbox.create("base", metadata={"sdk": "old"}, envs={"FOO": "bar"}, timeout=120, allow_internet_access=False)
try:
    report["stdout"] = sandbox.commands.run("echo hi $FOO; whoami").stdout
    sandbox.files.write("notes/a.txt", "old sdk")
    report["read"] = sandbox.files.read("/home/user/notes/a.txt")
    handle = sandbox.commands.run("tr a-z A-Z", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "piped\n")
    sandbox.commands.close_stdin(handle.pid)
    report["stdin"] = handle.wait().stdout
    report["listed"] = [s.sandbox_id for s in Sandbox.list().next_items() if s.metadata.get("sdk") == "old"]
    sandbox.pause()
    report["paused"] = sandbox.get_info().state.value
    report["after_connect"] = Sandbox.connect(sandbox.sandbox_id).commands.run("echo back").stdout
    report["state"] = sandbox.get_info().state.value
    report["id"] = sandbox.sandbox_id
finally:
    report["killed"] = sandbox.kill()
json.dump(report, sys.stdout)
