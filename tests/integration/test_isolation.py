"""The default security profile, checked from inside real sandboxes and from the host."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import corral
from corral.backends.common.host import CgroupLayout, NodeSysfs
from corral.backends.container.backend import _clone_cpusets_in_tiers
from corral.backends.container.oci import masked_directories
from corral.embedded import EmbeddedServer
from corral.procfs import superblocks


def _status(sandbox: corral.Sandbox) -> dict[str, str]:
    lines = sandbox.exec("cat /proc/self/status").stdout.splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_seccomp_no_new_privs_and_capabilities(sandbox: corral.Sandbox) -> None:
    status = _status(sandbox)
    assert status["Seccomp"] == "2"
    assert status["NoNewPrivs"] == "1"
    cap_sys_admin = 1 << 21
    assert int(status["CapEff"], 16) & cap_sys_admin == 0
    assert int(status["CapBnd"], 16) & cap_sys_admin == 0


def test_denied_syscalls(sandbox: corral.Sandbox) -> None:
    result = sandbox.exec("mount -t tmpfs none /mnt; echo rc=$?")
    assert "rc=0" not in result.stdout
    assert sandbox.exec("unshare -n true; echo rc=$?").stdout.strip() != "rc=0"


def test_own_namespaces(sandbox: corral.Sandbox) -> None:
    processes = sandbox.exec("ps -o pid,comm").stdout.splitlines()[1:]
    assert [p.split()[0] for p in processes][0] == "1"  # its own PID namespace: the agent is PID 1
    assert len(processes) <= 4
    links = sandbox.exec("ip -o link").stdout.splitlines()
    assert len(links) == 1 and ": lo:" in links[0]  # loopback only
    assert sandbox.exec("hostname").stdout.strip() == sandbox.id[-12:]


def test_no_network_beyond_loopback(sandbox: corral.Sandbox) -> None:
    """No routes at all, and the host's loopback is not the sandbox's (only loopback is used here)."""
    import socket

    assert sandbox.exec("ip route; ip -6 route").stdout.strip() == ""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = sandbox.exec(f"echo hi | nc -w 1 127.0.0.1 {port}; echo rc=$?", timeout_s=10)
        assert result.stdout.strip().endswith("rc=1")
        listener.settimeout(0.2)
        try:
            listener.accept()
            raise AssertionError("the sandbox reached a port on the host's loopback")
        except TimeoutError:
            pass


def test_masked_proc_paths(sandbox: corral.Sandbox) -> None:
    for path in ["/proc/kcore", "/proc/kpagecgroup", "/proc/sysrq-trigger"]:
        result = sandbox.exec(f"head -c 16 {path} | wc -c")
        assert result.stdout.strip() == "0", path
    assert sandbox.exec("echo 1 > /proc/sys/kernel/panic; echo rc=$?").stdout.strip() != "rc=0"


def test_masked_directories_are_empty_read_only_and_no_superblock_of_their_own(sandbox: corral.Sandbox) -> None:
    """Masked directories (/proc/acpi, /sys/firmware, ...) show nothing and take nothing, and are binds of the
    node's one empty directory: a tmpfs each would be three more superblocks per sandbox, and every superblock
    costs every memory cgroup of the node (corral/backends/container/oci.py)."""
    directories = masked_directories()
    assert directories, "this kernel has none of the masked directories: nothing to check"
    for path in directories:
        listing = sandbox.exec(f"ls -A {path} | wc -l; touch {path}/x 2>&1; echo rc=$?").stdout.splitlines()
        assert listing[0].strip() == "0" and listing[-1] != "rc=0", (path, listing)
    fstype = {}
    for line in sandbox.exec("cat /proc/self/mountinfo").stdout.splitlines():
        fields = line.split()
        fstype[fields[4]] = fields[fields.index("-") + 1]
    assert all(fstype.get(path) not in (None, "tmpfs") for path in directories), fstype  # binds: the host's fs
    assert {point for point, kind in fstype.items() if kind == "tmpfs"} == {"/dev"}, fstype


def _superblocks(sandbox: corral.Sandbox) -> dict[str, tuple[str, str]]:
    return superblocks(sandbox.exec("cat /proc/self/mountinfo").stdout)


def test_a_sandbox_has_five_superblocks_of_its_own(client: corral.Client) -> None:
    """Every superblock costs every memory cgroup of the node a shrinker slot, a term that grows with the square
    of the sandbox count (oci.py): a sandbox's own are its overlay root, its PID namespace's proc, its /dev tmpfs,
    its devpts and its IPC namespace's mqueue. /sys is a bind of the node's one sysfs and /dev/shm a directory of
    /dev, where each was one more (seven)."""
    with client.create("busybox") as first, client.create("busybox") as second:
        mine, theirs = _superblocks(first), _superblocks(second)
        own = sorted(kind for device, (kind, _) in mine.items() if device not in theirs)
        assert own == ["devpts", "mqueue", "overlay", "proc", "tmpfs"], mine
        shared = {point: kind for device, (kind, point) in mine.items() if device in theirs}
        assert shared.get("/sys") == "sysfs", shared


def test_dev_shm_and_sys_work_as_their_own_mounts_did(sandbox: corral.Sandbox) -> None:
    """/dev/shm, a directory of /dev: sticky and world-writable, so any user's shared memory works, and up to
    /dev's 64 MiB. /sys, the node's sysfs: readable, read-only, and its network interfaces are a loopback's, as
    the sandbox's own (none of the host's: the node's sysfs has a network namespace of its own)."""
    shm = sandbox.exec("stat -c %a /dev/shm; echo x > /dev/shm/root-file && echo root-wrote")
    assert shm.stdout.split() == ["1777", "root-wrote"], shm
    assert sandbox.exec("echo y > /dev/shm/nobody-file && cat /dev/shm/nobody-file", user="nobody").stdout == "y\n"
    full = sandbox.exec("dd if=/dev/zero of=/dev/shm/big bs=1M count=80 2>&1; echo rc=$?").stdout
    assert "No space left" in full and "rc=0" not in full, full
    assert sandbox.exec("cat /sys/kernel/mm/transparent_hugepage/enabled").stdout.strip().count("[") == 1
    assert sandbox.exec("ls /sys/devices/system/cpu").stdout.count("cpu0") == 1
    assert sandbox.exec("touch /sys/x 2>&1; echo rc=$?").stdout.strip().endswith("rc=1")
    host_interfaces = set(os.listdir("/sys/class/net")) - {"lo"}
    assert host_interfaces, "the host has no interface but lo: nothing to check"
    assert sandbox.exec("ls /sys/class/net").stdout.split() == ["lo"]  # as its own netns has: loopback only


def test_cgroup_limits_applied(client: corral.Client) -> None:
    with client.create("busybox", cpu=0.5, memory_mb=96, pids_max=40) as sandbox:
        cgroup = f"corral/{sandbox.id}"
        memory_v1 = Path("/sys/fs/cgroup/memory") / cgroup / "memory.limit_in_bytes"
        if memory_v1.exists():
            assert int(memory_v1.read_text()) == 96 << 20
            assert int((Path("/sys/fs/cgroup/pids") / cgroup / "pids.max").read_text()) == 40
            assert int((Path("/sys/fs/cgroup/cpu") / cgroup / "cpu.cfs_quota_us").read_text()) == 50_000
            assert int((Path("/sys/fs/cgroup/cpu") / cgroup / "cpu.cfs_period_us").read_text()) == 100_000
        else:
            unified = Path("/sys/fs/cgroup") / cgroup
            assert int((unified / "memory.max").read_text()) == 96 << 20
            assert (unified / "pids.max").read_text().strip() == "40"
            assert (unified / "cpu.max").read_text().split()[0] == "50000"


def test_a_sandboxs_cpuset_starts_as_its_tiers_so_the_runtime_writes_none(client: corral.Client) -> None:
    """On cgroup v1 the tiers' cpusets clone their CPUs and memory nodes into each new sandbox's: the runtime's own
    writes each walked every sibling and rebuilt the scheduler's domains over every cpuset, a cost that grew with
    the node's sandbox count (corral/backends/container/backend.py, ``_clone_cpusets_in_tiers``)."""
    root = Path("/sys/fs/cgroup/cpuset")
    assert (root / "cgroup.clone_children").exists(), "this host has no v1 cpuset hierarchy: nothing to check"
    with client.create("busybox") as sandbox, client.create("busybox", qos="batch") as batch:
        for tier, member in (("corral", sandbox), ("corral-batch", batch)):
            assert (root / tier / "cgroup.clone_children").read_text().strip() == "1"
            for name in ("cpuset.cpus", "cpuset.mems"):
                assert (root / tier / member.id / name).read_text() == (root / name).read_text() != "\n"
        allowed = sandbox.exec("grep Cpus_allowed_list /proc/self/status").stdout.split()[-1]
        root_cpus = (root / "cpuset.cpus").read_text().strip()
        assert allowed == root_cpus, (allowed, root_cpus)  # every CPU of the node, as before


def test_a_fresh_tier_is_made_to_clone_the_roots_cpuset_into_its_children() -> None:
    """The kernel keeps a tier's flag from run to run, so the test above alone would pass on a host where an earlier
    version set it: here the backend's step makes a tier that did not exist, and a child made in it has the root's
    CPUs and memory nodes without a write."""
    root = Path("/sys/fs/cgroup/cpuset")
    tier = root / f"corral-test-{os.getpid()}"
    try:
        _clone_cpusets_in_tiers(CgroupLayout.LEGACY, root, [f"/{tier.name}"])
        assert (tier / "cgroup.clone_children").read_text().strip() == "1"
        (tier / "child").mkdir()
        for name in ("cpuset.cpus", "cpuset.mems"):
            assert (tier / name).read_text() == (tier / "child" / name).read_text() == (root / name).read_text()
    finally:
        for directory in (tier / "child", tier):
            if directory.exists():
                directory.rmdir()


def test_a_node_sysfs_that_cannot_be_mounted_leaves_each_sandbox_its_own(tmp_path: Path) -> None:
    """Where the shared sysfs cannot be made, creates go on with a sysfs of each sandbox's own (as before it
    existed), said once, and nothing of the attempt is left mounted."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    node_sysfs = NodeSysfs(blocker)  # its mount point would be inside a file
    assert node_sysfs.path() is None and node_sysfs.path() is None
    assert str(blocker) not in Path("/proc/self/mounts").read_text()


async def test_creates_that_start_a_server_together_mount_its_sysfs_once(fresh_server: EmbeddedServer) -> None:
    """The node's sysfs is made by the first create; creates that arrive with it wait for that one, not each mount
    a sysfs of their own over the last (``ContainerBackend.create``, ``_node_preparing``)."""
    assert fresh_server.process is not None
    async with corral.AsyncClient(fresh_server.url, fresh_server.api_key) as client:
        sandboxes = await asyncio.gather(*(client.create("busybox") for _ in range(6)))
        try:
            mountinfo = Path(f"/proc/{fresh_server.process.pid}/mountinfo").read_text()
            node_sysfs = [line for line in mountinfo.splitlines() if line.split()[4].endswith("/run/sysfs")]
            assert len(node_sysfs) == 1, node_sysfs
            for sandbox in sandboxes:
                assert (await sandbox.exec("cat /sys/class/net/lo/operstate")).exit_code == 0
        finally:
            await asyncio.gather(*(sandbox.kill() for sandbox in sandboxes))


def test_sandboxes_make_no_session_keyring_each(client: corral.Client) -> None:
    """The runtime keeps the server's session keyring (``--no-new-keyring``): a keyring per container cost every
    create a name search among all of them (runtime.py), and no sandbox can use one (keyctl is refused)."""
    before = len(Path("/proc/keys").read_text().splitlines())
    with client.create("busybox"), client.create("busybox"), client.create("busybox"):
        during = len(Path("/proc/keys").read_text().splitlines())  # the keys root can see, one a line
    assert during - before < 3, (before, during)  # not one per sandbox (other tests' sandboxes may run meanwhile)


def test_open_files_are_bounded_and_cannot_be_raised(sandbox: corral.Sandbox) -> None:
    """RLIMIT_NOFILE is the node's setting, soft and hard; without CAP_SYS_RESOURCE no command raises it, and
    a command opening files past its limit gets EMFILE instead of filling the host's file table."""
    limits = sandbox.exec("ulimit -Sn; ulimit -Hn").stdout.split()
    assert limits == ["16384", "16384"]
    raised = sandbox.exec("ulimit -n 16385 && echo raised")
    assert raised.exit_code != 0 and "raised" not in raised.stdout
    lowered = sandbox.exec('ulimit -n 16 && for i in $(seq 3 40); do eval "exec $i</dev/null"; done')
    assert lowered.exit_code != 0 and "Too many open files" in lowered.stderr


def test_base_layer_is_read_only_and_shared(client: corral.Client, server: EmbeddedServer) -> None:
    with client.create("busybox") as first, client.create("busybox") as second:
        assert first.exec("echo hacked > /bin/busybox.note; rm /bin/ls; echo x >> /etc/passwd").exit_code == 0
        assert second.exec("ls /bin/ls && ! test -e /bin/busybox.note && ! grep -q '^x$' /etc/passwd").exit_code == 0
        assert server.process is not None  # the quota pool is mounted in the server's mount namespace only
        upper = Path(f"/proc/{server.process.pid}/root") / str(server.data_dir).lstrip("/") / "writable" / first.id
        assert (upper / "upper" / "bin" / "busybox.note").exists()  # writes land in the sandbox's own upper dir


def test_sandboxes_cannot_see_each_other(client: corral.Client) -> None:
    with client.create("busybox") as first, client.create("busybox") as second:
        first.exec("sleep 300 &")
        first.files.write("/tmp/only-first", "1")
        assert "sleep 300" not in second.exec("ps").stdout
        assert not second.files.exists("/tmp/only-first")


def test_agent_channel_not_reachable(sandbox: corral.Sandbox) -> None:
    result = sandbox.exec("ls -la /proc/1/fd/ 2>&1; cat /proc/1/environ 2>&1; echo end")
    assert "socket:" not in result.stdout  # the agent is not dumpable: its fds stay hidden
    assert sandbox.exec("ls /.corral").stdout.split() == ["agent"]
    assert sandbox.exec("echo x > /.corral/agent; echo rc=$?").stdout.strip() != "rc=0"


def _processes_where(predicate: Callable[[str], bool], what: str) -> set[int]:
    """Host pids with a /proc/<pid>/<what> entry (a file, or a link under a directory) that ``predicate`` accepts."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        path = Path("/proc", entry, what)
        try:
            texts = [os.readlink(link) for link in path.iterdir()] if path.is_dir() else [path.read_text()]
        except OSError:
            continue  # ended meanwhile
        if any(predicate(text) for text in texts):
            found.add(int(entry))
    return found


def test_the_runtimes_sealed_copy_stays_with_the_server(server: EmbeddedServer, sandbox: corral.Sandbox) -> None:
    """crun runs from a sealed in-memory copy the server holds (runtime.py `_sealed_copy`); no process of a sandbox
    may hold it (a descriptor leaked into a container would be a handle on the runtime's binary)."""
    sandbox.exec("sleep 30 >/dev/null 2>&1 &")
    holders = _processes_where(lambda target: "memfd:corral-crun" in target, "fd")
    in_sandbox = _processes_where(lambda cgroups: sandbox.id in cgroups, "cgroup")
    assert server.process is not None and server.process.pid in holders
    assert len(in_sandbox) >= 2, in_sandbox  # its agent and the sleep
    assert not holders & in_sandbox
