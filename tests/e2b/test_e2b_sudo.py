"""``sudo`` for the template's ``user``, as on E2B, and the boundary that holds after it.

The facade's sandboxes run without no_new_privs (``corral.setuid``), so setuid
sudo makes ``user`` root inside the sandbox. That root is the one
``user="root"`` already gives: the same capability bounding set, the same
seccomp filter, the same namespaces; nothing of the host's.
"""

from __future__ import annotations

import shlex
import socket

from e2b import Sandbox

import corral

CAP_SYS_MODULE = 1 << 16
CAP_SYS_ADMIN = 1 << 21
FINIT_MODULE_NR = 313  # x86_64
_FINIT_MODULE = f"import ctypes, sys; sys.exit(ctypes.CDLL(None).syscall({FINIT_MODULE_NR}, 0, b'', 0) != 0)"


def _status(sandbox: Sandbox, prefix: str, user: str) -> dict[str, str]:
    lines = sandbox.commands.run(f"{prefix}cat /proc/self/status", user=user).stdout.splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _exit_code(sandbox: Sandbox, cmd: str) -> int:
    return int(sandbox.commands.run(f"{cmd} >/dev/null 2>&1; echo $?").stdout.strip())


def test_sudo_gives_user_root_inside_the_sandbox(e2b_sandboxes: list) -> None:  # type: ignore[type-arg]
    sandbox = Sandbox.create("base", allow_internet_access=False)
    e2b_sandboxes.append(sandbox)
    assert sandbox.commands.run("id -u; sudo -n id -u", user="user").stdout == "1000\n0\n"
    done = sandbox.commands.run(
        "sudo useradd -m bob && echo ok | sudo tee /etc/installed >/dev/null && sudo chown bob /etc/installed"
        " && id -u bob && stat -c '%U %a' /etc/installed /home/bob"
    )  # what a package install does as root: system users, files under /etc
    assert done.stdout.splitlines() == ["1001", "bob 644", "bob 755"]
    assert sandbox.commands.run("sudo -n -u bob id -un").stdout == "bob\n"


def test_after_sudo_the_boundary_holds(e2b_sandboxes: list) -> None:  # type: ignore[type-arg]
    sandbox = Sandbox.create("base", allow_internet_access=False)
    e2b_sandboxes.append(sandbox)
    root = _status(sandbox, "", user="root")
    via_sudo = _status(sandbox, "sudo -n ", user="user")
    assert via_sudo["Uid"].split()[1] == "0" and via_sudo["NoNewPrivs"] == "0"
    assert via_sudo["CapBnd"] == root["CapBnd"] and via_sudo["CapEff"] == root["CapEff"]
    assert via_sudo["Seccomp"] == "2" and via_sudo["Seccomp_filters"] == root["Seccomp_filters"]
    assert int(via_sudo["CapBnd"], 16) & (CAP_SYS_ADMIN | CAP_SYS_MODULE) == 0
    host_name = socket.gethostname()
    refused = {  # each needs what the bounding set or the seccomp filter withholds
        "mount": "sudo -n mount -t tmpfs none /mnt",
        "user namespace": "sudo -n unshare -U true",
        "mount namespace": "sudo -n unshare -m true",
        "module": f"sudo -n python3 -c {shlex.quote(_FINIT_MODULE)}",
        "network device": "sudo -n ip link add dummy0 type dummy",
        "hostname": "sudo -n hostname changed-by-sudo",
        "sysctl": "sudo -n sh -c 'echo 1 > /proc/sys/kernel/sysrq'",
        "raw memory": "sudo -n head -c 1 /proc/kcore",
    }
    codes = {what: _exit_code(sandbox, cmd) for what, cmd in refused.items()}
    assert all(code != 0 for code in codes.values()), codes
    assert socket.gethostname() == host_name
    processes = sandbox.commands.run("sudo -n ls /proc | grep '^[0-9]'").stdout.split()
    assert "1" in processes and len(processes) < 10  # its own pid namespace: no host process in sight


def test_corral_sandboxes_keep_no_new_privs(client: corral.Client) -> None:
    """Without the label a sandbox of the same image keeps no_new_privs: sudo cannot raise ``user``."""
    with client.create(image="e2b-base", user="user", ttl_s=120) as sandbox:
        status = sandbox.exec("grep NoNewPrivs /proc/self/status").stdout.split()
        refused = sandbox.exec("sudo -n id -u")
    assert status == ["NoNewPrivs:", "1"]
    assert refused.exit_code != 0 and "no new privileges" in refused.stderr
