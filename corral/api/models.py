"""Typed request and response models shared by the HTTP API and the SDK.

The gateway validates requests with these and the SDK parses responses with
them, so the wire format is defined once. Units are in the field names.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DEFAULT_CPU",
    "DEFAULT_QOS",
    "DEFAULT_MEMORY_MB",
    "DEFAULT_PIDS_MAX",
    "DEFAULT_TTL_S",
    "DEFAULT_EXEC_TIMEOUT_S",
    "DEFAULT_OUTPUT_CAP_BYTES",
    "SandboxState",
    "CreateSandboxRequest",
    "SandboxInfo",
    "SetTtlRequest",
    "PauseResult",
    "AuditEvent",
    "GradeRequest",
    "GradeResult",
    "FnCallRequest",
    "FnCallResult",
    "FnCallBatch",
    "RunCodeTest",
    "RunCodeRequest",
    "RunCodeTestResult",
    "RunCodeResult",
    "PoolStats",
    "TrajectoryStep",
    "ReplayRequest",
    "ReplayMismatch",
    "ReplayResult",
    "BulkRequest",
    "BulkResult",
    "BatchCreateRequest",
    "BatchEvent",
    "ForkRequest",
    "CheckpointInfo",
    "ExecRequest",
    "RenameRequest",
    "UploadResult",
    "RemoveResult",
    "PtySize",
    "ExecResult",
    "Event",
    "ExecEvent",
    "CommandInfo",
    "FileInfo",
    "MkdirRequest",
    "is_registry_reference",
    "ImageConfig",
    "ImageInfo",
    "ImageDetail",
    "LayerChunks",
    "PullRequest",
    "PullEvent",
    "LayerInfo",
    "Environment",
    "NetworkRule",
    "NetworkPolicy",
    "NetworkStatus",
    "TagRequest",
    "SnapshotRequest",
    "SnapshotInfo",
    "BuildRequest",
    "BuildEvent",
    "EdgeLoad",
    "NodeStats",
    "ClusterNode",
]

DEFAULT_CPU = 1.0
# CPU class of a sandbox that names none: the normal weight every sandbox had before
DEFAULT_QOS: Literal["latency", "batch"] = "latency"
DEFAULT_MEMORY_MB = 512
DEFAULT_PIDS_MAX = 256
DEFAULT_TTL_S = 3600
DEFAULT_EXEC_TIMEOUT_S = 300.0
DEFAULT_OUTPUT_CAP_BYTES = 1 << 20


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SandboxState(StrEnum):
    """Life of a sandbox: ``creating`` → ``running`` ⇄ ``paused`` → ``ended``; ``lost`` when
    its edge can no longer account for it (e.g. it vanished during a restart)."""

    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    ENDED = "ended"
    LOST = "lost"


class NetworkRule(_Model):
    """Egress allowed (or with ``action="deny"``, dropped and counted) to ``cidr`` or ``host`` (and these
    ports, or all ports when empty) over ``protocol``."""

    cidr: str | None = Field(None, description="An address or network, e.g. 10.88.200.2 or 10.88.200.0/24.")
    host: str | None = Field(
        None,
        description="Instead of cidr: a host name, resolved by the node's resolver (CORRAL_NETWORK_HOSTS_FILE first) "
        "and again every CORRAL_NETWORK_RESOLVE_INTERVAL_S; the rule matches the addresses it has now.",
    )
    ports: list[int] = Field(default_factory=list, description="Destination ports; empty = all (tcp/udp).")
    protocol: Literal["tcp", "udp", "icmp", "any"] = "tcp"
    action: Literal["allow", "deny"] = "allow"


class NetworkPolicy(_Model):
    """A sandbox's network: plugged into the node's sandbox network with only this egress allowed. Rules are
    tried in order and the first match decides; what matches none is dropped and counted."""

    allow: list[NetworkRule] = Field(default_factory=list, description="Empty: plugged in, but nothing allowed out.")


class NetworkStatus(_Model):
    address: str | None = Field(description="The sandbox's IPv4 address; None when it has loopback only.")
    allow: list[NetworkRule] | None
    denied_egress_packets: int = 0
    denied_ingress_packets: int = 0


def is_registry_reference(ref: str) -> bool:
    """True when ``ref`` names an image in an OCI registry: its first component is a host (it has a dot or a
    port, or is localhost), e.g. ``127.0.0.1:5000/ns/img:tag``; ``busybox`` and ``debian-12:latest`` are local
    names. A create from a registry image not pulled yet pulls it first (no implicit docker.io: name the host)."""
    first, slash, _ = ref.partition("/")
    return bool(slash) and ("." in first or ":" in first or first == "localhost")


class Environment(_Model):
    """Independently versioned layers composed at create time: tools over workspace over base."""

    base: str = Field(description="Image ref (name or name:version) of the OS and runtimes.")
    workspace: str | None = Field(None, description="Image ref of the repository and its dependencies.")
    tools: str | None = Field(None, description="Image ref of the agent harness and utilities.")
    extra: list[str] = Field(default_factory=list, description="More image refs or layer digests, stacked on top.")


class CreateSandboxRequest(_Model):
    image: str = Field("busybox", description="Image name (name or name:version) from `GET /v1/images`.")
    environment: Environment | None = Field(None, description="Compose base/workspace/tools instead of `image`.")
    layers: list[str] | None = Field(
        None, description="Layer digests, bottom first, to stack instead of `image` or `environment`."
    )
    backend: Literal["container", "microvm", "vm"] = Field(
        "container",
        description="container: an OCI container (crun/runc). microvm: QEMU -M microvm with its own kernel. "
        "vm: QEMU q35 booting a full disk built from the layers. The same exec, files, pause and fork for all.",
    )
    runtime: Literal["crun", "runc", "runsc"] | None = Field(
        None, description="OCI runtime; the server's default when unset. runsc: gVisor (memory checkpoints too)."
    )
    cpu: float = Field(DEFAULT_CPU, gt=0, description="CPU cores (CFS quota).")
    qos: Literal["latency", "batch"] = Field(
        DEFAULT_QOS,
        description="CPU class. latency (the default): the normal CPU weight, ahead of batch work when the node is "
        "busy. batch: an idle-priority tier that gets only the CPU nothing else wants (its `cpu` quota still caps it).",
    )
    memory_mb: int = Field(DEFAULT_MEMORY_MB, gt=0, description="Memory limit in MiB; exceeding it OOM-kills.")
    pids_max: int = Field(DEFAULT_PIDS_MAX, ge=8, le=65536, description="Maximum processes inside the sandbox.")
    env: dict[str, str] = Field(
        default_factory=dict, description="Added to the image's environment (ImageConfig.env); these win."
    )
    cwd: str | None = Field(None, description="Default directory of commands; null = the image's, else /.")
    user: str | None = Field(
        None, description="User name or uid[:gid] that commands run as by default; null = the image's, else root."
    )
    labels: dict[str, str] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description='Place only on a node whose labels include every key=value here, e.g. {"disk": "ssd"} '
        "(a node's labels: CORRAL_NODE_LABELS). Forks and replays keep it.",
    )
    ttl_s: float | None = Field(
        DEFAULT_TTL_S, gt=0, description="Destroyed this many seconds after creation; null = never."
    )
    ttl_counts_paused: bool = Field(False, description="Count paused time against the TTL (by default it does not).")
    idle_pause_s: float | None = Field(
        None, gt=0, description="Pause automatically after this many seconds without a request; null = never."
    )
    network: NetworkPolicy | None = Field(
        None, description="Null (the default): loopback only. Else plugged in with this egress allowlist."
    )
    disk_mb: int | None = Field(
        None,
        ge=8,
        le=1 << 20,
        description="Size limit of the writable layer in MiB; null = the node's default (CORRAL_SANDBOX_DISK_MB).",
    )
    protected_paths: list[str] = Field(
        default_factory=list,
        description="Paths (prefixes) whose modification raises a critical audit event, e.g. the task's tests; "
        "system binaries and libraries are always protected.",
    )
    sensitive_paths: list[str] = Field(
        default_factory=list,
        description="Paths (files or directory trees) whose reading raises a critical audit event "
        "(sensitive_path_read), e.g. where hidden answers or logs of past runs could be; opening a file or "
        "listing a directory there counts.",
    )


class SandboxInfo(_Model):
    id: str
    edge_id: str
    state: SandboxState
    image: str
    backend: str
    runtime: str
    cpu: float
    qos: str = DEFAULT_QOS
    memory_mb: int
    pids_max: int
    user: str
    cwd: str
    labels: dict[str, str]
    node_selector: dict[str, str] = Field(default_factory=dict, description="The node labels it was placed by.")
    created_at: float = Field(description="Unix time, seconds.")
    expires_at: float | None = Field(None, description="Unix time when the TTL destroys it (moves on while paused).")
    ttl_counts_paused: bool = False
    idle_pause_s: float | None = None
    paused_at: float | None = None
    network: NetworkPolicy | None = None
    disk_mb: int | None = None
    ended_at: float | None = None
    end_reason: str | None = Field(
        None, description="Why it ended: killed, shutdown, ttl_expired, oom, exited, lost, error."
    )
    status_message: str | None = None


class PauseResult(_Model):
    sandbox: SandboxInfo
    memory_before_bytes: int = Field(description="The sandbox's memory when it was frozen.")
    memory_after_bytes: int = Field(
        description="Resident when the call returned: after the reclaim with wait_reclaim, else it goes on in the "
        "background."
    )
    reclaim_pending: bool = Field(description="The memory is still being pushed out (to swap, or dropped).")
    duration_ms: float


class BulkRequest(_Model):
    """One action on every live sandbox whose labels all match (e.g. a whole job or rollout)."""

    labels: dict[str, str] = Field(description="Selector: every key=value must match.")
    action: Literal["pause", "resume", "kill", "set_ttl"]
    ttl_s: float | None = Field(None, gt=0, description="set_ttl: seconds from now.")
    clear_ttl: bool = Field(False, description="set_ttl: remove the TTL instead.")


class BulkResult(_Model):
    matched: int
    done: list[str]
    failed: dict[str, str] = Field(description="sandbox id → what went wrong")


class BatchCreateRequest(CreateSandboxRequest):
    """``count`` sandboxes alike, created with back-pressure; results stream back as they are ready."""

    count: int = Field(ge=1, le=32_000, description="How many sandboxes (a training step's burst: up to 32,000).")
    concurrency: int = Field(512, ge=1, le=4096, description="Creates of this batch running at once.")
    per_node: int = Field(32, ge=1, le=1024, description="At most this many of them starting on one node at once.")


class BatchEvent(_Model):
    """One line of a batch create's NDJSON stream: a sandbox ready, one that failed, progress, or done."""

    type: Literal["sandbox", "error", "progress", "done"]
    index: int | None = Field(None, description="Which of the batch (0 to count-1), for sandbox and error.")
    sandbox: SandboxInfo | None = None
    error: dict[str, str] | None = Field(None, description='{"code", "message"} as in error bodies.')
    created: int | None = Field(None, description="progress/done: sandboxes ready so far.")
    failed: int | None = None
    total: int | None = None
    elapsed_s: float | None = None


class ForkRequest(_Model):
    count: int = Field(1, ge=1, le=256)
    labels: dict[str, str] = Field(default_factory=dict, description="Added to the parent's labels.")
    checkpoint: str | None = Field(
        None, description="VM sandboxes: start the children from this checkpoint of the parent instead of from now."
    )


class CheckpointInfo(_Model):
    """A VM sandbox's whole state at one moment (memory, processes, devices, disk), kept on its node
    until the sandbox ends."""

    id: str
    sandbox_id: str
    created_at: float = Field(description="Unix time, seconds.")
    size_bytes: int = Field(description="Disk used by its files (memory copy, device state, disk).")


class SetTtlRequest(_Model):
    ttl_s: float | None = Field(..., gt=0, description="Seconds from now; null removes the TTL.")


class PtySize(_Model):
    rows: int = Field(24, ge=1, le=1000)
    cols: int = Field(80, ge=1, le=1000)


class ExecRequest(_Model):
    cmd: str | list[str] = Field(..., description="A shell command (run by /bin/sh -c) or an argv list.")
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    timeout_s: float = Field(DEFAULT_EXEC_TIMEOUT_S, gt=0, le=86400)
    stdin: str | None = Field(None, description="Text written to the command's stdin, which is then closed.")
    output_cap_bytes: int = Field(
        DEFAULT_OUTPUT_CAP_BYTES, ge=0, le=1 << 30, description="Per stream; the rest is dropped and flagged."
    )
    step_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="The client's step id: a step sent again is answered from the trajectory log, not re-run.",
    )
    pty: PtySize | None = Field(
        None,
        description="Run on a pseudo-terminal of this size (its controlling terminal; output is all stdout; "
        "TERM defaults to xterm-256color). Input stays open: POST commands/{command_id}/stdin, and "
        "commands/{command_id}/resize.",
    )


class TrajectoryStep(_Model):
    """One entry of a sandbox's trajectory log."""

    seq: int = Field(description="Position in the sandbox's log, from 1, gap-free.")
    step_id: str
    kind: str = Field(
        description="exec, exec_stream, start; write_file, upload_tar, mkdir, remove, rename; checkpoint and "
        "restore (VMs, gVisor)"
    )
    request: dict[str, Any]
    state: Literal["started", "done", "lost"] = Field(description="lost: the server died while it ran")
    result: dict[str, Any] | None
    result_truncated: bool
    started_at: float
    finished_at: float | None
    files: list[str] | None = Field(None, description="Paths the step changed (steps with a client step id).")


class ReplayRequest(_Model):
    labels: dict[str, str] = Field(default_factory=dict, description="Labels of the new sandbox.")
    ttl_s: float | None = Field(DEFAULT_TTL_S, gt=0)


class ReplayMismatch(_Model):
    seq: int
    step_id: str
    field: str
    logged: Any
    replayed: Any


class ReplayResult(_Model):
    sandbox: SandboxInfo = Field(description="The fresh sandbox the log was replayed into (it keeps running).")
    steps: int = Field(description="Steps re-executed.")
    skipped: list[str] = Field(
        description="Step ids that could not be replayed (e.g. lost, or a file too large to log)."
    )
    mismatches: list[ReplayMismatch] = Field(description="Where the re-run differed from the log (exit code, output).")


class FnCallRequest(_Model):
    """One short isolated call: a command, or Python source whose ``main(*args)`` returns a JSON value."""

    cmd: str | list[str] | None = Field(None, description="A shell command or argv (give this or `code`).")
    code: str | None = Field(None, description="Python source defining main(*args); its return value is the result.")
    args: list[Any] = Field(default_factory=list, description="code: the arguments of main().")
    image: str | None = Field(None, description="Default: busybox for cmd, debian-12 for code.")
    environment: Environment | None = None
    files: dict[str, str] = Field(default_factory=dict, description="path → text, placed before the call.")
    stdin: str | None = Field(None, description="cmd: text on stdin.")
    timeout_s: float = Field(30.0, gt=0, le=3600)
    memory_mb: int = Field(256, gt=0)
    cpu: float = Field(1.0, gt=0)
    output_cap_bytes: int = Field(DEFAULT_OUTPUT_CAP_BYTES, ge=0, le=1 << 30)
    network: NetworkPolicy | None = Field(None, description="Null: no network (loopback only).")


class FnCallResult(_Model):
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    result: Any = Field(None, description="code: what main() returned.")
    error: str | None = Field(None, description="code: the exception main() raised, if any.")
    pool_hit: bool = Field(description="Served by a pre-warmed sandbox (else one was started for it).")
    duration_ms: float


class FnCallBatch(_Model):
    calls: list[FnCallRequest] = Field(max_length=1000)


class RunCodeTest(_Model):
    stdin: str = ""
    expected_stdout: str | None = Field(None, description="Compared after stripping trailing whitespace.")


class RunCodeRequest(_Model):
    """Run a program against tests, as reward checkers do: one isolated call per test."""

    language: Literal["python", "bash"]
    code: str
    tests: list[RunCodeTest] = Field(default_factory=lambda: [RunCodeTest()], max_length=1000)
    timeout_s: float = Field(10.0, gt=0, le=3600)
    memory_mb: int = Field(256, gt=0)
    image: str | None = Field(None, description="Default debian-12.")


class RunCodeTestResult(_Model):
    passed: bool
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    duration_ms: float


class RunCodeResult(_Model):
    passed: int
    total: int
    tests: list[RunCodeTestResult]


class PoolStats(_Model):
    image: str
    memory_mb: int
    cpu: float
    network: bool
    warm: int = Field(description="Idle sandboxes ready for a call.")
    target: int = Field(description="How many it keeps warm now (grows and shrinks with load).")
    in_use: int
    waiting: int = Field(0, description="Calls waiting in line for a sandbox of this pool.")
    hits: int
    misses: int
    recycled: int = Field(description="Sandboxes reused after a call that left nothing behind.")
    replaced: int = Field(description="Sandboxes thrown away after a call that changed something.")


class Event(_Model):
    """One line of the event stream (GET /v1/events): what happened to a sandbox or a node."""

    id: int = Field(description="Increasing across the cluster; pass the last one seen as after_id to resume.")
    at: float = Field(description="Unix time.")
    kind: Literal[
        "sandbox.running", "sandbox.paused", "sandbox.resumed", "sandbox.ended", "node.up", "node.lost",
        "node.back", "audit",
    ] = Field(description="sandbox.ended carries state (ended, lost), reason and message; audit carries the finding "
                          "(audit_id, kind, severity, detail); node.lost how many sandboxes it took.")  # fmt: skip
    sandbox_id: str | None = None
    edge_id: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


class AuditEvent(_Model):
    id: int = Field(description="Increasing; pass the last one seen as after_id to follow the stream.")
    sandbox_id: str
    at: float
    kind: str = Field(
        description="e.g. oom_kill, pids_limit, disk_full, timeout, output_capped, protected_path_modified, "
        "packages_modified, network_denied, syscall_denied, sensitive_path_read, and detector findings such as "
        "probe_kernel_memory or modifies_tests"
    )
    severity: Literal["info", "warning", "critical"]
    detail: dict[str, Any]


class GradeRequest(_Model):
    """Grade a sandbox's final state in a separate sandbox the agent never touched."""

    cmd: str | list[str] = Field(description="The grader command (a shell string runs under the trusted /bin/sh).")
    hidden: list[str] = Field(
        default_factory=list, description="Images or layers with tests and answers: added only for grading."
    )
    trusted: list[str] = Field(
        default_factory=list,
        description="Images or layers stacked on top (the shell, test runner, interpreter the grader relies on), "
        "so nothing the agent replaced is used.",
    )
    reward_path: str | None = Field(None, description="The file the grader writes its reward to (read back).")
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    timeout_s: float = Field(600.0, gt=0, le=86400)


class GradeResult(_Model):
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    reward: str | None = Field(
        description="What the grader wrote to reward_path (what the agent wrote there is ignored)."
    )
    grader_layers: list[str] = Field(description="The grader sandbox's layers, bottom first.")


class ExecResult(_Model):
    exit_code: int | None = Field(description="None while running; -N when killed by signal N.")
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_ms: float = 0.0
    command_id: str | None = None
    replayed: bool = Field(False, description="Answered from the trajectory log: the step had run before.")


class ExecEvent(_Model):
    """One line of a streamed exec: output chunks, then exactly one ``exit``, or ``error`` when the command's
    end is unknown because the stream broke off (the sandbox ended while it ran, or its node went away; the SDK
    raises it)."""

    type: Literal["started", "stdout", "stderr", "exit", "error"]
    data: str | None = None
    command_id: str | None = None
    result: ExecResult | None = None
    error: dict[str, str] | None = Field(None, description='error: {"code", "message"} as in error bodies.')


class CommandInfo(_Model):
    command_id: str
    cmd: str | list[str]
    running: bool
    result: ExecResult


class FileInfo(_Model):
    path: str
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    uid: int
    gid: int
    link_target: str | None = None


class MkdirRequest(_Model):
    path: str
    parents: bool = True
    mode: int = 0o755


class RenameRequest(_Model):
    source: str = Field(description="Absolute path inside the sandbox.")
    dest: str = Field(
        description="The new path (rename(2)): parents are made; a file there is replaced, a directory refused."
    )


class UploadResult(_Model):
    members: int = Field(description="Tar members extracted.")


class RemoveResult(_Model):
    path: str


class ImageConfig(_Model):
    """What an image says about the processes run from it (the OCI image config's ``config`` object, in
    Corral's names). Sandboxes created from the image get ``env``, ``working_dir`` and ``user`` as defaults."""

    env: dict[str, str] = Field(default_factory=dict, description="Environment variables, in definition order.")
    working_dir: str | None = Field(None, description="Default directory of commands (WORKDIR).")
    user: str | None = Field(None, description="Default user of commands, name or uid[:gid] (USER).")
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    exposed_ports: list[str] = Field(default_factory=list, description='e.g. ["8080/tcp"] (EXPOSE).')


class ImageInfo(_Model):
    name: str = Field(description="name:version (host/repo:tag or host/repo@digest for pulled images)")
    layers: list[str] = Field(description="Layer digests, bottom first.")
    size_bytes: int
    created_at: float
    source: str | None = Field(None, description="The registry reference it was pulled from; null if built here.")
    manifest_digest: str | None = Field(None, description="Digest of the pulled image manifest (linux/amd64).")
    config: ImageConfig = Field(default_factory=ImageConfig)


class LayerInfo(_Model):
    digest: str
    size_bytes: int
    kind: Literal["base", "workspace", "tools", "diff"]
    parents: list[str] = Field(description="Layers it was built on, bottom first.")
    source: dict[str, Any] = Field(description="The builder and its inputs.")
    labels: dict[str, str]
    created_at: float


class LayerChunks(_Model):
    """A layer's chunk index: the sha256 of each ``chunk_bytes`` of it, for nodes that fetch it on demand."""

    digest: str
    size_bytes: int
    chunk_bytes: int
    chunks: list[str] = Field(description="sha256 (hex) of each chunk in order; the last may be shorter.")
    kind: Literal["base", "workspace", "tools", "diff"]


class ImageDetail(_Model):
    name: str
    layers: list[LayerInfo] = Field(description="Bottom first.")
    size_bytes: int
    created_at: float
    source: str | None = Field(None, description="The registry reference it was pulled from; null if built here.")
    manifest_digest: str | None = Field(None, description="Digest of the pulled image manifest (linux/amd64).")
    config: ImageConfig = Field(default_factory=ImageConfig)


class TagRequest(_Model):
    layers: list[str] | None = Field(None, description="Layer digests, bottom first.")
    source: str | None = Field(None, description="An existing image ref whose layers the new tag gets.")


class SnapshotRequest(_Model):
    name: str | None = Field(None, description="Tag the result as this image (name or name:version).")


class SnapshotInfo(_Model):
    diff: LayerInfo = Field(description="The sandbox's changes as a layer.")
    layers: list[str] = Field(description="The sandbox's layers plus the diff: create from these to continue.")
    image: str | None = Field(None, description="The tag, when a name was given.")


class BuildRequest(_Model):
    """One layer built on the server. Paths are on the server's machine."""

    name: str = Field(description="Tag the result as name or name:version.")
    kind: Literal["dir", "tar", "oci", "debootstrap", "git", "commands", "dockerfile"]
    layer_kind: Literal["base", "workspace", "tools", "diff"] | None = Field(
        None, description="Default: base for debootstrap and oci, workspace for git, tools otherwise."
    )
    path: str | None = Field(None, description="dir, tar, oci: the source; git: the repository.")
    commit: str | None = Field(None, description="git: the commit, branch or tag (default HEAD).")
    workspace_path: str = Field("/work", description="git: where the checkout goes in the image.")
    suite: str = Field("bookworm", description="debootstrap: the Debian suite.")
    packages: list[str] = Field(default_factory=list, description="debootstrap: extra packages.")
    on: list[str] = Field(
        default_factory=list, description="commands (and git setup): image refs or digests to run on."
    )
    commands: list[str] = Field(default_factory=list, description="commands, or git setup commands, run in order.")
    env: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(1800, gt=0, description="Per command.")
    no_cache: bool = Field(False, description="Build even if identical inputs were built before.")
    network: NetworkPolicy | None = Field(
        None,
        description="commands, dockerfile RUN: the builder sandbox's egress allowlist (e.g. a package mirror); "
        "null = none.",
    )
    dockerfile: str | None = Field(None, description="dockerfile: the Dockerfile's path.")
    context: str | None = Field(
        None, description="dockerfile: the build context directory (default: the Dockerfile's directory)."
    )
    build_args: dict[str, str] = Field(default_factory=dict, description="dockerfile: values for its ARGs.")
    target: str | None = Field(None, description="dockerfile: build up to this stage (default: the last).")


class BuildEvent(_Model):
    """One line of a streamed build: progress lines, then ``done`` or ``error``.

    A Dockerfile build sends one progress event per instruction with ``step`` and ``steps`` set
    (``cached`` says whether its result came from the build cache), then the output of the steps that run."""

    type: Literal["progress", "done", "error"]
    message: str | None = None
    step: int | None = Field(None, description="dockerfile: the instruction's number, from 1 ...")
    steps: int | None = Field(None, description="... of this many.")
    image: ImageInfo | None = None
    cached: bool | None = None
    error: dict[str, str] | None = None


class PullRequest(_Model):
    reference: str = Field(description="host[:port]/repository[:tag][@sha256:...] of an OCI registry.")


class PullEvent(_Model):
    """One line of a streamed pull: progress (bytes of the layers to download), then ``done`` or ``error``."""

    type: Literal["progress", "done", "error"]
    message: str | None = None
    layer: str | None = Field(None, description="The OCI layer digest this line is about.")
    bytes_done: int | None = Field(None, description="Layer bytes downloaded so far, of bytes_total.")
    bytes_total: int | None = Field(None, description="Compressed bytes of the layers not already here.")
    image: ImageInfo | None = None
    layers_pulled: int | None = None
    layers_reused: int | None = Field(None, description="Layers already here from earlier pulls: not downloaded.")
    bytes_transferred: int | None = Field(None, description="Bytes received from the registry by this pull.")
    error: dict[str, str] | None = None


class NodeStats(_Model):
    """One node as its edge sees it: what runs there, what is promised, what is used, how pressed it is."""

    edge_id: str
    sandboxes: dict[str, dict[str, int]] = Field(description="Count per backend, then per state (running, paused).")
    cpu_cores: float
    cpu_committed: float = Field(description="CPU promised to admitted sandboxes.")
    cpu_overcommit: float = Field(description="cpu_committed / cpu_cores.")
    cpu_capacity: float = Field(description="What admission allows: cores × the CPU overcommit factor.")
    load_1m: float
    memory_total_mb: int
    memory_available_mb: int = Field(description="MemAvailable: what the node can still give without swapping.")
    memory_committed_mb: int = Field(description="Memory promised to admitted sandboxes.")
    memory_capacity_mb: int = Field(description="What admission allows: RAM × the memory overcommit factor.")
    memory_resident_mb: float = Field(description="What the sandboxes hold now (cgroup usage; VMs: QEMU PSS).")
    memory_reclaimed_mb: float = Field(description="Node swap in use: mostly paused sandboxes' memory (zram).")
    memory_merged_mb: float = Field(0.0, description="Memory KSM saves by merging identical pages (mergeable VMs).")
    swap_total_mb: int
    pressure: dict[str, float] = Field(description="PSI avg10 in percent: cpu_some, memory_some, memory_full, io_some.")
    refusing: str | None = Field(None, description="Why the node refuses new sandboxes right now, if it does.")
    layer_cache_bytes: int | None = Field(
        None,
        description="Disk taken by the layers this node fetched from the layer source, complete and partial "
        "(blocks on disk); none: the node has no cache of its own (its layers are the gateway's store).",
    )


class ClusterNode(_Model):
    """A node as the shared state knows it: what the watcher decided and the load its last heartbeat carried."""

    edge_id: str
    state: Literal["up", "lost"]
    last_seen: float = Field(description="Unix time of its last heartbeat.")
    lost_at: float | None = None
    load: EdgeLoad


class EdgeLoad(_Model):
    edge_id: str
    node_cpu: float = Field(description="Physical cores; no sandbox may ask for more.")
    node_memory_mb: int = Field(description="Physical memory; no sandbox may ask for more.")
    sandboxes: int
    cpu_committed: float
    cpu_capacity: float
    memory_committed_mb: int
    memory_capacity_mb: int
    backends: list[str] = Field(default_factory=list, description="Backends the node runs; empty: not reported.")
    runtimes: list[str] = Field(
        default_factory=list, description="OCI runtimes the node has for container sandboxes; empty: not reported."
    )
    offers: dict[str, list[str]] = Field(
        default_factory=dict,
        description="The kinds of sandbox the node runs (`backend`, or `backend/runtime` for a backend that takes an "
        "OCI runtime) with the capabilities each declares (checkpoints, cpu_classes, layers); empty: not reported.",
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="The node's labels (CORRAL_NODE_LABELS), matched by node_selector."
    )
