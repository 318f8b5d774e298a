"""Known cheats and escapes of RL agents, each tried for real inside a real sandbox.

Each test asserts three things: the attempt fails or is contained, the host and a bystander sandbox are
unharmed, and the trainer sees an audit event. (test_guard.py covers grading isolation, protected test
files, quota events and the event stream.)
"""

from __future__ import annotations

import hashlib
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
from corral.api.models import AuditEvent
from tests.kernel_log import KernelWatch


@pytest.fixture
def bystander(client: corral.Client) -> Iterator[corral.Sandbox]:
    """Another sandbox on the same node, holding a file; it must come out of every attack unchanged."""
    with client.create("debian-12") as sandbox:
        sandbox.files.write("/work/state.txt", "untouched\n")
        kernel = KernelWatch()
        try:
            yield sandbox
            assert sandbox.files.read_text("/work/state.txt") == "untouched\n"
            assert sandbox.exec("bash -c 'echo $((6 * 7))'").stdout == "42\n"
            assert sandbox.audit_events() == []
            assert kernel.problems() == []  # no kernel warning, oops or bad module on the host meanwhile
        finally:
            kernel.close()


def _events(sandbox: corral.Sandbox, kind: str, key: str | None = None, wait_s: float = 10.0) -> list[AuditEvent]:
    """Its events of one kind (kernel-reported ones come with the edge's housekeeping, about once a second)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [e for e in sandbox.audit_events() if e.kind == kind and (key is None or e.detail.get("key") == key)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


EXTENT_SWAP = r"""
import ctypes, errno, os, struct
libc = ctypes.CDLL(None, use_errno=True)
mine = os.open("/work/mine", os.O_RDWR | os.O_CREAT, 0o644)
os.write(mine, b"m" * 65536)
target = os.open("/work/protected", os.O_RDONLY)
swapext = struct.pack("qqqqq", 0, mine, target, 0, 65536).ljust(192, b"\0")
attempts = {
    "EXT4_IOC_MOVE_EXT": (0xC028660F, struct.pack("IIQQQQ", 0, target, 0, 0, 16, 0)),
    "EXT4_IOC_SWAP_BOOT": (0x6611, b""),
    "XFS_IOC_SWAPEXT": (0xC0C0586D, swapext),
    "XFS_IOC_EXCHANGE_RANGE": (0x40285881, struct.pack("iIQQQQ", target, 0, 0, 0, 65536, 0)),
    "FIDEDUPERANGE": (0xC0189436, struct.pack("QQHHI", 0, 65536, 1, 0, 0) + struct.pack("qQQiI", target, 0, 0, 0, 0)),
    # the kernel keeps only the low 32 bits of the request: high bits must not slip past the filter
    "XFS_IOC_SWAPEXT|1<<32": ((1 << 32) | 0xC0C0586D, swapext),
    "FS_IOC_GETFLAGS": (0x80086601, bytes(8)),  # harmless, for contrast: not refused by the profile
}
for name, (request, arg) in attempts.items():
    buf = ctypes.create_string_buffer(arg, max(len(arg), 8))
    rc = libc.ioctl(mine, ctypes.c_ulong(request), buf)
    print(name, "ok" if rc == 0 else errno.errorcode[ctypes.get_errno()])
"""


def test_extent_swap_ioctls_are_refused(client: corral.Client, bystander: corral.Sandbox) -> None:
    with client.create("debian-12", disk_mb=64) as sandbox:  # the writable layer on btrfs (the quota pool)
        sandbox.exec("mkdir -p /work && echo the-answer > /work/protected && chmod 0400 /work/protected")
        result = sandbox.exec(f"python3 -c {shlex.quote(EXTENT_SWAP)}")
        outcome = dict(line.split() for line in result.stdout.splitlines())
        assert result.exit_code == 0, result.stderr
        refused = {name: errno for name, errno in outcome.items() if name != "FS_IOC_GETFLAGS"}
        assert set(refused.values()) == {"EPERM"}, outcome  # seccomp, before any filesystem sees it
        assert outcome["FS_IOC_GETFLAGS"] != "EPERM"
        assert sandbox.exec("cat /work/protected").stdout == "the-answer\n"
        ioctl = _events(sandbox, "syscall_denied", key="ioctl")
        assert ioctl and ioctl[0].severity == "critical" and ioctl[0].detail["first"][0]["comm"] == "python3"


NEW_NAMESPACES = r"""
import ctypes, os, threading
libc = ctypes.CDLL(None, use_errno=True)
def clone(flags):  # clone(2) like fork, plus the namespace flags; the child only exits
    pid = libc.syscall(56, flags | 17, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
        return "ok"
    return os.strerror(ctypes.get_errno())
print("user", clone(0x10000000))
print("user+mount+net", clone(0x10000000 | 0x00020000 | 0x40000000))
print("clone3", "ok" if libc.syscall(435, 0, 0) >= 0 else os.strerror(ctypes.get_errno()))
started = []
threads = [threading.Thread(target=started.append, args=(i,)) for i in range(50)]
[t.start() for t in threads]
[t.join() for t in threads]
print("threads", len(started))
"""


def test_new_namespaces_are_refused(client: corral.Client, bystander: corral.Sandbox) -> None:
    with client.create("debian-12") as sandbox:
        result = sandbox.exec(f"python3 -c {shlex.quote(NEW_NAMESPACES)}")
        assert result.stdout.splitlines() == [
            "user Operation not permitted",  # no user namespace, so no mount or network namespace of its own
            "user+mount+net Operation not permitted",
            "clone3 Function not implemented",  # flags in memory: refused whole, glibc falls back to clone
            "threads 50",
        ], result.stderr
        clone = _events(sandbox, "syscall_denied", key="clone")
        assert clone and clone[0].severity == "critical" and clone[0].detail["count"] >= 1
        assert [e for e in sandbox.audit_events() if e.detail.get("key") == "clone3"] == []  # glibc's probe: quiet


def test_recursive_read_of_proc_is_contained(client: corral.Client, bystander: corral.Sandbox) -> None:
    with client.create("busybox") as sandbox:
        # /proc lists kpage* first; the walk then reads every process's pagemap (sparse, huge): the timeout ends it
        walk = sandbox.exec("grep -r x /proc >/dev/null 2>&1; echo walked", timeout_s=15)
        assert walk.timed_out or walk.stdout == "walked\n"
        sizes = sandbox.exec(
            "for f in /proc/kpagecgroup /proc/kpagecount /proc/kpageflags /proc/kcore; do "
            "cat $f 2>/dev/null | wc -c; done"
        )
        assert sizes.stdout.split() == ["0", "0", "0", "0"]  # masked: nothing of the host's memory map
        assert sandbox.exec("echo alive").stdout == "alive\n"
        assert _events(sandbox, "walks_proc")[0].severity == "warning"
        assert _events(sandbox, "probe_kernel_memory")[0].severity == "critical"


def test_unbounded_yes_is_capped_in_the_log(client: corral.Client, bystander: corral.Sandbox) -> None:
    cap = 32 << 20
    with client.create("busybox") as sandbox:
        received = 0
        exit_event = None
        for event in sandbox.exec_stream("yes", timeout_s=3, output_cap_bytes=cap, step_id="flood"):
            if event.type == "stdout":
                received += len(event.data or "")
            elif event.type == "exit":
                exit_event = event
        assert exit_event is not None and exit_event.result is not None
        assert exit_event.result.stdout_truncated and received <= cap  # the agent drops what is over the cap
        step = sandbox.trajectory()[-1]
        assert step.step_id == "flood" and step.result_truncated and step.result is not None
        assert len(step.result["stdout"]) == 1 << 20  # the log keeps 1 MiB per stream
        assert step.result["log_cap"]["stdout_bytes"] == received
        kinds = {e.kind for e in sandbox.audit_events()}
        assert {"output_capped", "timeout"} <= kinds
        assert sandbox.exec("echo alive").stdout == "alive\n"


INSTALL_NEWER = """set -e
mkdir -p /tmp/pkg/DEBIAN /tmp/pkg/usr/lib/python3/dist-packages/solver
printf 'Package: solver\\nVersion: 99.0\\nArchitecture: all\\nMaintainer: a <a@b>\\nDescription: has the fix\\n' \
  > /tmp/pkg/DEBIAN/control
echo 'FIXED = True' > /tmp/pkg/usr/lib/python3/dist-packages/solver/__init__.py
dpkg-deb --build /tmp/pkg /tmp/solver.deb >/dev/null
dpkg -i /tmp/solver.deb >/dev/null
mkdir -p /usr/local/lib/python3.11/dist-packages/checker
echo '__version__ = "99.0"' > /usr/local/lib/python3.11/dist-packages/checker/__init__.py
python3 -c 'import solver, checker; print(solver.FIXED, checker.__version__)'
"""


def test_installing_newer_packages_is_flagged(client: corral.Client, bystander: corral.Sandbox) -> None:
    with client.create("debian-12") as sandbox:
        result = sandbox.exec(INSTALL_NEWER)
        assert result.stdout == "True 99.0\n", result.stderr  # it worked inside the sandbox...
        found = _events(sandbox, "packages_modified")  # ...and the trainer sees it
        assert found and found[0].severity == "warning"
        paths = found[0].detail["paths"]
        assert "/var/lib/dpkg/status" in paths
        assert "/usr/lib/python3/dist-packages/solver/__init__.py" in paths
        assert "/usr/local/lib/python3.11/dist-packages/checker/__init__.py" in paths
        assert any(e.kind == "package_pin_or_upgrade" for e in sandbox.audit_events())  # the dpkg -i, by a detector
        assert bystander.exec("python3 -c 'import solver' 2>&1; echo rc=$?").stdout.endswith("rc=1\n")
        assert not Path("/usr/lib/python3/dist-packages/solver").exists()


FORGE = r"""
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
frame = b"\0\0\0\x20\x01\0\0\0\x01" + b'{"argv":["touch","/forged"]}'  # what an exec order looks like
def attempt(name, call):
    try:
        call()
        print(name, "ok")
    except OSError as exc:
        print(name, errno.errorcode.get(exc.errno, exc.errno))
attempt("see_agent_socket", lambda: os.readlink("/proc/1/fd/3"))  # the names list, but not what they are
attempt("open_agent_fd", lambda: os.write(os.open("/proc/1/fd/3", os.O_WRONLY), frame))
def pidfd_getfd():
    pidfd = os.pidfd_open(1)
    fd = libc.syscall(438, pidfd, 3, 0)  # pidfd_getfd: steal the agent's socket
    if fd < 0:
        raise OSError(ctypes.get_errno(), "pidfd_getfd")
    os.write(fd, frame)
attempt("pidfd_getfd", pidfd_getfd)
def ptrace_agent():
    if libc.ptrace(16, 1, 0, 0) != 0:  # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), "ptrace")
attempt("ptrace_attach", ptrace_agent)
def write_agent_memory():
    data = ctypes.create_string_buffer(frame)
    local = (ctypes.c_void_p * 2)(ctypes.cast(data, ctypes.c_void_p), len(frame))
    remote = (ctypes.c_void_p * 2)(0x400000, len(frame))
    if libc.process_vm_writev(1, local, 1, remote, 1, 0) < 0:
        raise OSError(ctypes.get_errno(), "process_vm_writev")
attempt("process_vm_writev", write_agent_memory)
paths = [line.split()[-1] for line in open("/proc/net/unix").read().splitlines()[1:] if len(line.split()) > 7]
def connect_any():
    for path in paths:
        s = socket.socket(socket.AF_UNIX)
        s.connect("\0" + path[1:] if path.startswith("@") else path)
        s.sendall(frame)
    raise OSError(errno.ENOENT, "no socket")
attempt("unix_sockets", connect_any)
"""


def test_forging_a_control_channel_request_fails(client: corral.Client, bystander: corral.Sandbox) -> None:
    with client.create("debian-12") as sandbox:
        result = sandbox.exec(f"python3 -c {shlex.quote(FORGE)}")
        outcome = dict(line.split() for line in result.stdout.splitlines())
        assert result.exit_code == 0, result.stderr
        assert "ok" not in outcome.values(), outcome
        assert outcome["process_vm_writev"] == "EPERM" and outcome["unix_sockets"] == "ENOENT"
        assert sandbox.exec("test -e /forged; echo $?").stdout == "1\n"
        assert sandbox.exec("echo still-obeys-the-edge").stdout == "still-obeys-the-edge\n"
        assert _events(sandbox, "syscall_denied", key="process_vm_writev")[0].severity == "critical"
        assert _events(sandbox, "probes_agent_channel")


def test_overwriting_bash_is_caught_and_stays_in_the_sandbox(client: corral.Client, bystander: corral.Sandbox) -> None:
    host_bash = hashlib.sha256(Path("/bin/bash").read_bytes()).hexdigest()
    with client.create("debian-12") as sandbox:
        sandbox.exec("printf '#!/bin/dash\\necho pwned\\n' > /bin/bash && chmod 755 /bin/bash")
        assert sandbox.exec("bash -c 'echo real'").stdout == "pwned\n"  # later shells in this sandbox are hijacked
        found = _events(sandbox, "protected_path_modified")
        assert found and found[0].severity == "critical" and "/usr/bin/bash" in found[0].detail["paths"]
        graded = sandbox.grade("bash -c 'echo graded-by-real-bash'", trusted=["debian-12"])
        assert graded.stdout == "graded-by-real-bash\n"  # the grader's bash comes from the trusted image
    assert hashlib.sha256(Path("/bin/bash").read_bytes()).hexdigest() == host_bash
    assert bystander.exec("bash -c 'echo real'").stdout == "real\n"
