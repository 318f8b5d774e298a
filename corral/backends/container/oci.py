"""The OCI runtime spec (config.json) of a container sandbox: Corral's default
security profile lives here.

Isolation: new mount, PID, UTS, IPC and network namespaces (the network one
has only loopback); cgroup limits for CPU, memory and PIDs; a seccomp profile
that refuses what sandboxed agents never need (and has the kernel log each refusal);
extent-swapping ioctls and new namespaces refused; a reduced capability set;
no_new_privs; masked and read-only /proc and /sys paths. The agent binary is
bind-mounted read-only at AGENT_PATH and runs as the container's init.

Masked directories are read-only binds of one empty directory of the node
(``mask_dir``), not the runtime's read-only tmpfs each: every tmpfs is a
superblock of its own, and the kernel keeps, in every memory cgroup, a slot
for every memcg-aware shrinker, one per superblock (``alloc_shrinker_info``:
~1 KiB per 64 shrinkers per cgroup, sized by the most superblocks the node has
had since boot). With a cgroup and ~10 superblocks per sandbox that grows with
the square of the sandbox count: 17.9 GiB of unreclaimable slab at 9,509 idle
sandboxes (``corral bench density``), 1.5 MiB for each new cgroup after that
until a reboot. Three of the ten were these masks. (runc refuses mounts inside
/proc: its sandboxes keep the tmpfs masks.) For the same reason a crun sandbox's
/sys is a read-only bind of the node's one sysfs (``NodeSysfs``) and its
/dev/shm a directory of its /dev tmpfs, which the agent makes (``--shm``): five
superblocks of its own (overlay root, proc, /dev, devpts, the IPC namespace's
mqueue), where a sysfs and a tmpfs of their own made seven.

A sandbox that allows setuid programs (``SandboxSpec.setuid_allowed``: E2B's
templates, whose ``user`` has sudo) runs without no_new_privs, as Docker's
containers do: setuid sudo then makes a process root *inside* the sandbox,
which is what the API's ``user="root"`` already gives. Nothing else changes:
the runtime installs the same seccomp filter (before it drops its own
capabilities, since without no_new_privs the kernel wants CAP_SYS_ADMIN for
that), the bounding set caps what any exec can gain, and the namespaces stay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "AGENT_PATH",
    "AGENT_NEW_PRIVS_ARGS",
    "AGENT_SHM_ARGS",
    "CAPABILITIES",
    "CLONE_NAMESPACE_FLAGS",
    "DENIED_IOCTLS",
    "DENIED_SYSCALLS",
    "ContainerLimits",
    "build_config",
    "masked_directories",
]

AGENT_PATH = "/.corral/agent"
AGENT_NEW_PRIVS_ARGS = ("--new-privs", "allowed")  # the agent leaves no_new_privs off for its commands (agent.c)
AGENT_SHM_ARGS = ("--shm", "/dev/shm")  # the agent makes this directory (mode 1777) where no mount put one
CFS_PERIOD_US = 100_000

# Docker's default set minus NET_RAW and MKNOD: enough to switch users and
# own files, not enough to touch the host.
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
]

# Refused with EPERM. Kernel modules, kexec, reboot, mounts, swap, eBPF, perf,
# userfaultfd, io_uring, keyrings, namespace games, clock changes, raw I/O.
DENIED_SYSCALLS = [
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "create_module",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "get_kernel_syms",
    "init_module",
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "ioperm",
    "iopl",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "mount_setattr",
    "move_mount",
    "name_to_handle_at",
    "nfsservctl",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "process_vm_readv",
    "process_vm_writev",
    "quotactl",
    "quotactl_fd",
    "reboot",
    "request_key",
    "setns",
    "settimeofday",
    "swapoff",
    "swapon",
    "syslog",
    "umount",
    "umount2",
    "unshare",
    "uselib",
    "userfaultfd",
    "ustat",
    "vhangup",
    "adjtimex",
    "query_module",
    "sysfs",
    "_sysctl",
    "afs_syscall",
    "fanotify_init",
]
# clone3 is answered ENOSYS (glibc falls back to clone; EPERM would break threads) by corral-launch's own,
# unlogged filter (--refuse-clone3): glibc tries it before every thread and spawn, and this filter logs.

# clone(2) with any of these flags: a new namespace (a user namespace above all, which unprivileged processes
# could otherwise make, and with it mount and network namespaces of their own). One rule per bit, because a
# rule's argument checks must all hold. (CLONE_NEWTIME is left out: in clone(2) that bit is the exit signal.)
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

# ioctl requests refused with EPERM: swapping or moving extents between files (the documented way to read a
# protected file, which corrupted the filesystem), swapping the boot loader inode, and dedupe (a content
# oracle). Clone/reflink (FICLONE) stays: cp tries it and falls back, and it shares no data you cannot read.
DENIED_IOCTLS = {
    "EXT4_IOC_MOVE_EXT": 0xC028660F,
    "EXT4_IOC_SWAP_BOOT": 0x00006611,
    "XFS_IOC_SWAPEXT": 0xC0C0586D,
    "XFS_IOC_EXCHANGE_RANGE": 0x40285881,
    "FIDEDUPERANGE": 0xC0189436,
}
_IOCTL_CMD_MASK = 0xFFFFFFFF  # the kernel truncates the request to 32 bits: compare only those

MASKED_PATHS = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/kpagecgroup",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/kmsg",
    "/proc/sysrq-trigger",
    "/sys/firmware",
    "/sys/kernel/debug",
    "/sys/devices/virtual/powercap",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"]


DEFAULT_OPEN_FILES = 16384


@dataclass(frozen=True)
class ContainerLimits:
    cpu: float
    memory_mb: int
    pids_max: int
    cpu_shares: int = 1024  # v1 weight (the kernel's default); corral.backends.common.qos sets it per class
    open_files: int = DEFAULT_OPEN_FILES  # RLIMIT_NOFILE, soft and hard: without CAP_SYS_RESOURCE it stays


def _seccomp(log_denials: bool) -> dict[str, Any]:
    """With ``log_denials`` (SECCOMP_FILTER_FLAG_LOG; crun has it, runc 1.1 refuses flags) the kernel writes an
    audit record (type 1326) for every refused call, which the edge turns into audit events (kernel_watch.py)."""

    def refused_when(name: str, index: int, mask: int, value: int) -> dict[str, Any]:
        masked = {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}
        return {"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": 1, "args": [masked]}

    ioctls = [refused_when("ioctl", 1, _IOCTL_CMD_MASK, request) for request in DENIED_IOCTLS.values()]
    clones = [refused_when("clone", 0, flag, flag) for flag in CLONE_NAMESPACE_FLAGS.values()]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        **({"flags": ["SECCOMP_FILTER_FLAG_LOG"]} if log_denials else {}),
        "syscalls": [
            {"names": DENIED_SYSCALLS, "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
            *ioctls,
            *clones,
        ],
    }


def masked_directories() -> list[str]:
    """The masked paths that are directories on this kernel (in a container's /proc and /sys as on the host's)."""
    return [path for path in MASKED_PATHS if Path(path).is_dir()]


def _mask_binds(mask_dir: Path, directories: Sequence[str]) -> list[dict[str, Any]]:
    return [{"destination": path, "type": "bind", "source": str(mask_dir),
             "options": ["bind", "ro", "nosuid", "noexec", "nodev"]} for path in directories]  # fmt: skip


def _mounts(agent_binary: Path, node_sysfs: Path | None) -> list[dict[str, Any]]:
    """With ``node_sysfs``: /sys a bind of it and no /dev/shm mount (the agent makes the directory in /dev)."""
    nosuid_noexec = ["nosuid", "noexec", "nodev"]
    if node_sysfs is None:
        shm = [{"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                "options": [*nosuid_noexec, "mode=1777", "size=65536k"]}]  # fmt: skip
        sysfs = {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": [*nosuid_noexec, "ro"]}
    else:
        shm = []
        sysfs = {"destination": "/sys", "type": "bind", "source": str(node_sysfs),
                 "options": ["bind", "ro", *nosuid_noexec]}  # fmt: skip
    return [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": nosuid_noexec},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
        },
        *shm,
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": nosuid_noexec},
        sysfs,
        {
            "destination": AGENT_PATH,
            "type": "bind",
            "source": str(agent_binary),
            "options": ["bind", "ro", "nosuid", "nodev"],
        },
    ]


def build_config(
    *,
    hostname: str,
    limits: ContainerLimits,
    cgroup_path: str,
    agent_binary: Path,
    log_denials: bool = True,
    setuid_allowed: bool = False,
    mask_dir: Path | None = None,
    masked_dirs: Sequence[str] = (),
    node_sysfs: Path | None = None,
) -> dict[str, Any]:
    """The config.json for one sandbox; ``root.path`` is ``rootfs`` in the bundle. ``setuid_allowed``: without
    no_new_privs (see the module's docstring). ``mask_dir``: an empty directory that masks ``masked_dirs``
    (``masked_directories()``) as read-only binds; the runtime masks the others, and all without it, with tmpfs.
    ``node_sysfs``: the node's sysfs, bound at /sys, and /dev/shm made by the agent (the module's docstring);
    without it a sysfs and a /dev/shm tmpfs of the sandbox's own."""
    binds = _mask_binds(mask_dir, masked_dirs) if mask_dir else []
    bound = {bind["destination"] for bind in binds}
    capabilities = {key: list(CAPABILITIES) for key in ("bounding", "effective", "permitted")}
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [
                AGENT_PATH,
                *(AGENT_NEW_PRIVS_ARGS if setuid_allowed else ()),
                *(AGENT_SHM_ARGS if node_sysfs is not None else ()),
            ],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "capabilities": capabilities,
            "noNewPrivileges": not setuid_allowed,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": limits.open_files, "soft": limits.open_files}],
        },
        "root": {"path": "rootfs", "readonly": False},
        "hostname": hostname,
        "mounts": _mounts(agent_binary, node_sysfs) + binds,
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "cgroupsPath": cgroup_path,
            "resources": {
                "memory": {"limit": limits.memory_mb << 20, "swap": limits.memory_mb << 20},
                "cpu": {
                    "shares": limits.cpu_shares,
                    "quota": max(1000, int(limits.cpu * CFS_PERIOD_US)),
                    "period": CFS_PERIOD_US,
                },
                "pids": {"limit": limits.pids_max},
                "devices": [{"allow": False, "access": "rwm"}],
            },
            "seccomp": _seccomp(log_denials),
            "maskedPaths": [path for path in MASKED_PATHS if path not in bound],
            "readonlyPaths": READONLY_PATHS,
        },
    }
