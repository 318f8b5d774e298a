"""Server settings: one typed object, every field overridable as ``CORRAL_<NAME>``.

The table of settings in docs/configuration.md is generated from this class's
field descriptions, so document a new setting here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from corral.sdk._config import default_config_path

__all__ = ["Settings"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CORRAL_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address the HTTP API listens on.")
    port: int = Field(7070, description="Port the HTTP API listens on.")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Server log lines on stderr: text, or one JSON object per line (ts, level, logger, "
        "message, sandbox_id, edge_id).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="The least severe log lines written (info: every create, kill, pause and resume)."
    )
    otel_traces: bool = Field(
        False,
        description="Export OpenTelemetry traces of sandbox create and exec (needs `pip install 'corral[otel]'`) "
        "over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT (default http://localhost:4318), as OTEL_SERVICE_NAME "
        "(default corral); off, OpenTelemetry is not even imported (docs/observability.md).",
    )
    http_keepalive_s: int = Field(
        620,
        gt=0,
        description="How long the HTTP API keeps an idle client connection open. Longer than any client keeps one "
        "(the e2b SDK: 300 s, Corral's SDK: 60 s), so the server never closes a connection a client is sending on.",
    )
    data_dir: Path = Field(
        Path("/var/lib/corral/server"), description="This server's state: database, sandboxes, runtime state."
    )
    node_dir: Path = Field(
        Path("/var/lib/corral"),
        description="Node-wide files shared by every server on the machine: layer store, compiled helpers.",
    )
    config_file: Path = Field(
        default_factory=default_config_path,
        description="Client config (URL and API key) that serve writes and the SDK and CLI read.",
    )
    database_url: str | None = Field(None, description="SQLAlchemy URL; default SQLite at <data_dir>/corral.db.")
    edge_id: str = Field(
        "e0", pattern=r"^[a-z0-9]{1,16}$", description="Id of this node's edge; part of every sandbox id."
    )
    engine: Literal["embedded", "ray"] = Field(
        "embedded",
        description="embedded: this server is the gateway and its node's edge. ray: this server is a gateway only; "
        "the edges are the Ray cluster's edge actors, one per node (docs/cluster.md).",
    )
    ray_address: str | None = Field(
        None, description="The Ray cluster (its GCS host:port) a ray-engine gateway joins; default: RAY_ADDRESS."
    )
    edge_channel: bool = Field(
        True,
        description="ray engine: a node's edge actor also listens on its node's address, and each gateway sends "
        "its calls over one connection it keeps open there (an exec's round trip through a Ray actor call is "
        "several ms; large transfers still go through Ray). false: every call through Ray.",
    )
    edge_channel_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="The port of that listener; 0: one the system picks (gateways learn it "
        "through Ray). Set one where a firewall between gateways and nodes must let it through.",
    )
    api_key: str | None = Field(
        None,
        description="The API key; default: generated on first start and kept in <data_dir>/api_key. Every gateway "
        "and node of a cluster uses the same one.",
    )
    runtime: Literal["crun", "runc", "runsc"] = Field(
        "crun", description="Default OCI runtime for container sandboxes."
    )
    cpu_overcommit: float = Field(64.0, gt=0, description="Admitted CPU may reach this multiple of the node's cores.")
    memory_overcommit: float = Field(
        4.0, gt=0, description="Admitted memory may reach this multiple of the node's RAM."
    )
    create_concurrency: int = Field(
        8, ge=1, description="Container creations the edge runs at once; more wait in line."
    )
    destroy_concurrency: int = Field(
        16, ge=1, description="Container teardowns the edge runs at once (a bulk kill); more wait in line."
    )
    max_file_bytes: int = Field(256 << 20, description="Largest file or tar upload/download through the API.")
    max_logged_file_bytes: int = Field(
        1 << 20,
        ge=0,
        description="File writes and tar uploads up to this size are kept whole in the trajectory log (for replay).",
    )
    ttl_check_interval_s: float = Field(1.0, gt=0, description="How often expired sandboxes are looked for.")
    agent_start_timeout_s: float = Field(
        10.0, gt=0, description="How long a new sandbox's agent may take to say hello."
    )

    fncall_min_warm: int = Field(2, ge=0, description="fncall: sandboxes each pool keeps warm when idle.")
    fncall_max_per_pool: int = Field(32, ge=1, description="fncall: the largest a pool grows under load.")
    fncall_warm_budget: int = Field(
        32, ge=0, description="fncall: warm sandboxes across all pools on this node (they count against admission)."
    )
    warm_pool_memory_mb: int = Field(
        0,
        ge=0,
        description="Warm pools: container, microvm and vm sandboxes started ahead of demand, per shape (layers, "
        "backend, runtime, cpu, memory, pids, CPU class, disk), which creates claim instead of starting one (a "
        "container: ~1 ms instead of ~17 ms; a VM: tens of ms instead of a restore or boot of 0.3-6 s on TCG). "
        "Their memory limits together stay within this many MiB (they count against admission as any sandbox); "
        "0 (the default) = no pools (docs/architecture.md, Warm pools).",
    )
    warm_pool_window_s: float = Field(
        60.0,
        gt=0,
        description="Warm pools: a pool keeps as many sandboxes as its shape had creates in this many seconds.",
    )
    stop_with_pid: int | None = Field(
        None,
        gt=0,
        description="A throwaway server's caller (the tests, a benchmark, the demo): when that process ends, however "
        "it ends (SIGKILL too), the server kills every sandbox it runs, pools' included, and stops. Unset (the "
        "default): a server outlives whatever started it, and its sandboxes outlive a restart.",
    )
    sandbox_fusion_open: bool = Field(
        False,
        description="SandboxFusion API: POST /run_code and /run_jupyter at the root need no key (SandboxFusion clients "
        "send none). Only for a server that nothing but the trainer can reach; otherwise use the key-in-URL routes "
        "that `corral sandbox-fusion` prints.",
    )
    sandbox_fusion_image: str = Field(
        "debian-12-toolchains",
        description="SandboxFusion API: the image C, C++, Java, Go and Node.js run on. The default is built on the "
        "node's first call that needs it; another must have gcc, g++, javac, go and node on its PATH.",
    )
    idle_pause_s: float | None = Field(
        None,
        gt=0,
        description="Pause sandboxes idle this long (no request, no command running) unless they say otherwise.",
    )
    pause_swap_mb: int = Field(
        4096,
        ge=0,
        description="Compressed swap (zram) the node sets up at start, if it has no swap, so paused sandboxes "
        "can give back their anonymous memory; 0 = never touch the host's swap.",
    )
    audit_repeat_window_s: float = Field(
        30.0,
        gt=0,
        description="Repeats of a kernel-reported audit event (a refused syscall, a read of a sensitive path) "
        "in one sandbox are counted and reported at most once per this many seconds.",
    )
    sandbox_disk_mb: int = Field(
        10240,
        ge=0,
        description="Size limit of a container sandbox's writable layer (data and metadata) unless its create "
        "asks for another (disk_mb); a writer past it gets EDQUOT. The layers live in one btrfs per node with "
        "a quota per sandbox (a sparse image under the data dir); 0 = no limit by default.",
    )
    sandbox_open_files: int = Field(
        16384,
        ge=64,
        le=1 << 20,
        description="RLIMIT_NOFILE (soft and hard) of every process in a container sandbox: a sandbox cannot "
        "raise it (no CAP_SYS_RESOURCE), so one agent opening files without end hits EMFILE, not the host's "
        "file table. At most the node's own hard limit (raised to fs.nr_open where the node may).",
    )
    sandbox_output_buffer_mb: int = Field(
        64,
        ge=1,
        description="Output of a sandbox's background commands (POST /commands) the edge keeps until read: past "
        "it, finished commands are forgotten (oldest first), then new output is dropped and flagged truncated.",
    )
    events_retention_s: float = Field(
        7 * 86400.0,
        gt=0,
        description="The event stream (GET /v1/events) keeps events this long; a client resuming from an older "
        "id gets what is left.",
    )
    layer_idle_unmount_s: float = Field(
        60.0, ge=0, description="A layer no sandbox has used for this long is unmounted (its sandboxes keep theirs)."
    )
    layer_disk_budget_mb: int | None = Field(
        None,
        ge=0,
        description="Keep the layer store under this size: after a build, a pull (one a create starts too) or a "
        "snapshot, untagged layers no sandbox uses are deleted, least recently used first. Unset: never delete.",
    )
    layer_cache_budget_mb: int | None = Field(
        None,
        ge=0,
        description="Keep this node's copies of layers fetched from the layer source (complete ones, and partial "
        "ones counted by the bytes on disk) under this size: as creates fetch, layers no sandbox on the node uses "
        "are deleted, least recently used first, tagged or not (they are fetched again when next used). Unset: "
        "CORRAL_LAYER_DISK_BUDGET_MB. A setting of its own because a gateway's store holds the originals and a "
        "node's cache only copies (corral/images/cache.py).",
    )

    memory_reserve_mb: int = Field(
        1024, ge=0, description="The node refuses new sandboxes when less memory than this is available (MemAvailable)."
    )
    disk_floor_mb: int = Field(
        1024,
        ge=0,
        description="The node refuses new sandboxes when the data dir's filesystem has less free space than this "
        "(the refusal names the sandboxes that wrote most), so the state database and the layer cache keep room; "
        "the writable layers together can never take the last half of it (their pool is sized so); 0 = no floor.",
    )
    memory_full_pressure_pct: float = Field(
        10.0, gt=0, description="... or when memory pressure (PSI full avg10, %) is above this: the node thrashes."
    )
    pressure_pause_idle_s: float = Field(
        30.0, ge=0, description="While memory is short, sandboxes idle this long are paused (their memory reclaimed)."
    )
    node_labels: dict[str, str] = Field(
        {},
        description='Labels of this node, as JSON, e.g. {"zone": "a", "disk": "ssd"}. A create with a node_selector '
        "is placed only on nodes whose labels include every key=value of it.",
    )
    node_heartbeat_s: float = Field(1.0, gt=0, description="How often this server's edges report to the shared state.")
    node_lost_after_s: float = Field(
        15.0, gt=0, description="A node silent this long is marked lost, and every sandbox on it with it."
    )
    adopt_concurrency: int = Field(
        16,
        ge=1,
        description="Sandboxes a restarted server or edge re-attaches to at once (its runtime state, its agent, its "
        "network); it answers only after every one was tried.",
    )
    node_restart_grace_s: float = Field(
        120.0,
        ge=0,
        description="A cluster node whose edge Ray is restarting (its process died, its machine did not) may stay "
        "silent this much longer before it is marked lost: the restarted edge re-adopts its sandboxes.",
    )
    create_orphan_after_s: float = Field(
        60.0,
        gt=0,
        description="A cluster node ends a sandbox whose record still says creating this long after it was recorded, "
        "when no create of it is in progress on the node: the gateway that asked went away before it answered.",
    )
    layer_source_url: str | None = Field(
        None,
        description="The shared layer store: a Corral gateway (URL) this node fetches the layers it lacks from, "
        "once per layer, verified by sha256. Unset: layers must be on this node.",
    )
    layer_source_key: str | None = Field(
        None, description="API key for the layer store; default: this server's own key (one cluster, one key)."
    )
    layer_fetch: Literal["on_demand", "eager"] = Field(
        "on_demand",
        description="How a node gets a layer it lacks from the layer source. on_demand: mounted at once, each "
        "256 KiB chunk fetched (HTTP Range) and verified when first read, then kept; complete layers become ordinary "
        "store files. eager: the whole blob fetched and verified before the first mount (also the fallback when "
        "FUSE or libfuse3 is missing). docs/images.md.",
    )
    layer_read_timeout_s: float = Field(
        30.0, gt=0, description="on_demand: the longest a read of a layer waits for its chunks; then it fails (EIO)."
    )
    layer_chunk_timeout_s: float = Field(
        10.0, gt=0, description="on_demand: the HTTP timeout of one chunk request (tried twice before EIO)."
    )
    layer_helper_orphan_s: float = Field(
        900.0,
        gt=0,
        description="on_demand: how long a layer's FUSE helper waits for a server after its own went away (an edge "
        "killed): the next server reattaches to it and its sandboxes read on; with none by then it exits.",
    )
    insecure_registries: Annotated[list[str], NoDecode] = Field(
        [],
        description="Registries (host:port, comma-separated) pulled from over plain HTTP, and never over https: a "
        "listed registry that answers with TLS is refused (remove it from the list). Every other registry is reached "
        "over https only, its certificate verified.",
    )
    registry_ca_file: Path | None = Field(
        None,
        description="A PEM bundle of CA certificates trusted for registries' https certificates, in addition to the "
        "system's trust store (e.g. the CA of a private registry); read at start. A certificate that chains to "
        "neither is refused, with the reason (unknown issuer, wrong host, expired).",
    )
    registry_credentials: dict[str, str] = Field(
        {},
        description='Registry credentials as JSON, {"host:port": "user:password"}; they answer a registry\'s Basic '
        "challenge or get its Bearer token. Over the auth file's for the same registry.",
    )
    registry_auth_file: Path | None = Field(
        None,
        description='A docker-style auth.json ({"auths": {"host:port": {"auth": base64 of user:password}}}) with '
        "registry credentials; read at start.",
    )
    pull_max_layer_bytes: int = Field(
        32 << 30, gt=0, description="The most file bytes one pulled OCI layer may unpack to; a bigger one is refused."
    )
    vm_accel: Literal["auto", "kvm", "tcg"] = Field(
        "auto",
        description="microvm/vm accelerator: auto boots a probe guest under KVM (bounded) and falls back to TCG.",
    )
    vm_memory: Literal["shared", "mergeable"] = Field(
        "shared",
        description="microvm/vm guest RAM: shared (a /dev/shm file: snapshots and forks copy it, fast) or mergeable "
        "(anonymous memory KSM dedupes across guests: denser, but a snapshot streams all of it). mergeable turns "
        "the host's KSM on.",
    )
    vm_templates: bool = Field(
        True,
        description="microvm/vm creates without network restore a booted machine of the same shape (kept per node) "
        "instead of booting, then get their own hostname and fresh entropy; the first create of a shape boots.",
    )
    vm_boot_timeout_s: float = Field(
        90.0, gt=0, description="How long a microvm/vm guest may take to boot before its create fails."
    )
    internet_egress: Literal["public", "off"] = Field(
        "public",
        description="What an internet grant (E2B's allow_internet_access, on by default there) gives a sandbox. "
        "public: egress to public addresses only, never private (RFC 1918), CGNAT, loopback, link-local or metadata "
        "(169.254.169.254) ranges (docs/e2b.md lists them), counted when denied; the sandbox network has no uplink "
        "yet, so this sets what may leave, not a route. off: no internet; an explicit "
        "allow_internet_access=True create fails, and an unset one gets none.",
    )
    network_hosts_file: Path | None = Field(
        None,
        description="A hosts file (the /etc/hosts format) read before the node's resolver for host names in egress "
        "rules, e.g. names of peers on the sandbox network.",
    )
    network_resolve_interval_s: float = Field(
        30.0, gt=0, description="How often host names in egress rules are resolved again; changed addresses reload "
        "the sandbox's rules at once.",
    )  # fmt: skip

    @field_validator("insecure_registries", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @property
    def database(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'corral.db'}"

    @property
    def layer_dir(self) -> Path:
        return self.node_dir / "layers"
