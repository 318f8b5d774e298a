"""A Corral cluster on Ray: its processes, started, joined, inspected and stopped.

``LocalCluster`` runs a whole cluster on this machine (a head, a gateway, N
nodes as separate raylets, PostgreSQL): `corral cluster up|status|down`, the
cluster tests and `corral bench cluster`. ``join_node`` is the part that runs
on each real machine (`corral cluster join`). Everything the cluster started
is recorded in ``<dir>/cluster.json``; each node's processes share a session
of their own, so `down` ends exactly them, by pid.

On one machine the whole cluster lives in a network namespace of its own
(cluster/network.py): Ray refuses loopback node addresses, and this way no
Ray process ever uses the machine's outward address. Ray's usage reporting
is off. A node joined with ``own_network`` gets a namespace of its own behind
a veth pair (``NodeNetwork``), the database over TCP, and can be cut off from
the cluster and restored (``cut_node``/``restore_node``): a partition.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.engine import make_url

from corral.cluster.edge_actor import node_resource
from corral.cluster.network import FORWARD_READY, ClusterNetwork, NodeNetwork
from corral.embedded import EmbeddedServer, delete_leftover_sandboxes
from corral.procfs import stat_fields
from corral.sdk import Client, CorralError

__all__ = ["ClusterState", "LocalCluster", "NodeProcess", "join_node", "LOCAL_RAY_ENV", "stop_session"]

CLUSTER_FILE = "cluster.json"
LOCAL_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}
"""No usage reports (they would go to the internet)."""
NODE_RAY_ENV = {"RAY_kill_child_processes_on_worker_exit": "0"}
"""Every Ray node Corral starts: a worker that exits gracefully (SIGTERM) kills its direct children by default, and
the edge actor's worker is the node's subreaper, so its children are every sandbox's init and every VM's QEMU; they
must outlive it, for the edge that Ray starts again to re-adopt them (as after a SIGKILL, which skips that cleanup)."""
NODE_UP_TIMEOUT_S = 180.0
_STOP_GRACE_S = 10.0
# Ray's processes do not end on SIGTERM in any useful time (a head's gcs_server and `ray start --block` outlive
# 15 s of it, measured here); a node that stops is gone as if its machine went away anyway.
_RAY_STOP_GRACE_S = 3.0
_REPO = Path(__file__).resolve().parents[2]


@dataclass
class NodeProcess:
    edge_id: str
    session: int  # the launcher's pid = the session id of the raylet and its workers
    data_dir: str
    labels: dict[str, str] = field(default_factory=dict)
    netns: str | None = None  # the node's own network namespace (``own_network``), if it has one


@dataclass
class ClusterState:
    directory: str
    ray_address: str
    head_session: int
    gateway_pid: int
    gateway_url: str
    api_key: str
    database_url: str
    postgres_dir: str | None
    netns: str | None = None
    forwarder_pid: int = 0  # the relay of host loopback ports into the namespace (forward_ports), if any
    replicas: list[int] = field(default_factory=list)  # pids of gateway replicas beyond the first
    database_relay_pid: int = 0  # PostgreSQL's socket offered over TCP in the namespace, once a node needs it
    database_relay_url: str = ""  # the database URL over that relay
    nodes: dict[str, NodeProcess] = field(default_factory=dict)

    def save(self) -> None:
        path = Path(self.directory) / CLUSTER_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, directory: Path) -> ClusterState:
        path = directory / CLUSTER_FILE
        if not path.exists():
            raise FileNotFoundError(f"no cluster in {directory} (no {CLUSTER_FILE}): run `corral cluster up` first")
        raw = json.loads(path.read_text())
        raw["nodes"] = {edge_id: NodeProcess(**node) for edge_id, node in raw["nodes"].items()}
        return cls(**raw)


def _ray_binary() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _reap_if_zombie(pid: int, state: str) -> bool:
    """True if the process has exited (a zombie is reaped when it is our child)."""
    if state != "Z":
        return False
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return True


def _session_members(session: int) -> list[int]:
    """Live processes of a session (zombies left out)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = stat_fields(int(entry.name))
        # fields[0] is the state, fields[3] the session id (fields 3 and 6 of /proc/PID/stat)
        if fields is not None and int(fields[3]) == session and not _reap_if_zombie(int(entry.name), fields[0]):
            members.append(int(entry.name))
    return members


def stop_session(session: int, grace_s: float = _RAY_STOP_GRACE_S) -> None:
    """End every process of a session this module started: SIGTERM to each, SIGKILL to what is left."""
    stop_sessions([session], grace_s)


def stop_sessions(sessions: list[int], grace_s: float = _RAY_STOP_GRACE_S) -> None:
    """``stop_session`` for several sessions at once: one grace period for all of them."""
    if any(session <= 1 for session in sessions):
        raise ValueError(f"refusing to end sessions {sessions}: not all are ones this module started")

    def members() -> list[int]:
        return [pid for session in sessions for pid in _session_members(session)]

    for pid in members():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while members() and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in members():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "corral.cluster.launch", *args]


def _in_netns(netns: str | None, command: list[str]) -> list[str]:
    return _launch("netns", netns, "--", *command) if netns else command


def start_ray_node(
    ray_args: list[str], env: dict[str, str], log_path: Path, *, namespace: bool = True, netns: str | None = None
) -> subprocess.Popen[bytes]:
    """`ray start --block` in a session of its own (inside a node's mount namespace when ``namespace``)."""
    command = [_ray_binary(), "start", "--block", *ray_args]
    env = {**env, **NODE_RAY_ENV}  # the raylet's, which its workers (the edge actor's) inherit
    if namespace:
        command = _launch("node", *(["--netns", netns] if netns else []), "--", *command)
    else:
        command = _in_netns(netns, command)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )


def create_edge_actor(
    address: str, edge_id: str, env: dict[str, str], log_path: Path, netns: str | None,
    raylet: subprocess.Popen[bytes] | None = None,
) -> int:  # fmt: skip
    """Create (or find) the node's edge actor and wait for it; its worker's pid. Fails early if ``raylet``
    (the node's `ray start`) exits first."""
    command = _launch("edge", *(["--netns", netns] if netns else []), "--address", address, "--edge-id", edge_id)
    deadline = time.monotonic() + NODE_UP_TIMEOUT_S
    with open(log_path, "ab") as log:
        driver = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log)
        try:
            while driver.poll() is None:
                if raylet is not None and raylet.poll() is not None:
                    raise RuntimeError(f"node {edge_id}'s raylet exited ({raylet.returncode}); {_tails(log_path)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"edge {edge_id} did not start within {NODE_UP_TIMEOUT_S:.0f} s; {_tails(log_path)}"
                    )
                time.sleep(0.2)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
        assert driver.stdout is not None
        output = driver.stdout.read().decode()
    if driver.returncode != 0:
        raise RuntimeError(f"edge {edge_id} did not start; {_tails(log_path)}")
    return int(output.split()[-1])


def _tails(*logs: Path) -> str:
    """The ends of a failed start's logs (the edge driver's and its node's raylet)."""
    paths = [*logs, *(log.with_name(log.name.replace("edge-", "ray-")) for log in logs)]
    return "\n".join(f"{path} ends:\n{path.read_text(errors='replace')[-2000:]}" for path in paths if path.is_file())


def node_env(
    *, edge_id: str, data_dir: Path, node_dir: Path, database_url: str, gateway_url: str, api_key: str,
    labels: dict[str, str] | None = None, extra: dict[str, str] | None = None,
) -> dict[str, str]:  # fmt: skip
    """A node's settings, as the environment its raylet (and so its edge actor) runs with."""
    env = {
        **os.environ,
        "CORRAL_EDGE_ID": edge_id,
        "CORRAL_DATA_DIR": str(data_dir),
        "CORRAL_NODE_DIR": str(node_dir),
        "CORRAL_DATABASE_URL": database_url,
        "CORRAL_LAYER_SOURCE_URL": gateway_url,
        "CORRAL_API_KEY": api_key,
        **(extra or {}),
    }
    if labels:
        env["CORRAL_NODE_LABELS"] = json.dumps(labels)
    return env


def join_node(
    address: str, edge_id: str, env: dict[str, str], log_dir: Path, *, ray_args: list[str] | None = None,
    netns: str | None = None,
) -> tuple[subprocess.Popen[bytes], int]:  # fmt: skip
    """Start this machine's raylet (offering the edge's resource) and its edge actor: (raylet session, actor pid)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    resources = json.dumps({node_resource(edge_id): 1})
    process = start_ray_node(
        ["--address", address, "--num-cpus", "1", "--resources", resources, "--disable-usage-stats",
         *(ray_args or [])],
        env, log_dir / f"ray-{edge_id}.log", netns=netns,
    )  # fmt: skip
    try:
        pid = create_edge_actor(address, edge_id, env, log_dir / f"edge-{edge_id}.log", netns, process)
    except BaseException:
        stop_session(process.pid)
        raise
    return process, pid


class LocalCluster:
    """A cluster of ``nodes`` Corral nodes on this machine, each its own raylet, behind one gateway."""

    def __init__(
        self,
        directory: Path,
        *,
        database_url: str | None = None,
        node_dir: Path | None = None,
        node_settings: dict[str, str] | None = None,
        gateway_settings: dict[str, str] | None = None,
        forward_ports: list[int] | None = None,
    ) -> None:
        """``forward_ports``: host loopback ports the cluster reaches as its own 127.0.0.1:<port> (a registry
        on this machine's loopback; cluster/network.py, ``forward_loopback``)."""
        self.directory = directory
        self._database_url = database_url
        self._node_dir = node_dir
        self._node_settings = node_settings or {}
        self._gateway_settings = gateway_settings or {}
        self._forward_ports = forward_ports or []
        self.state: ClusterState | None = None

    # -- up --------------------------------------------------------------------

    def up(self, nodes: int, progress: Callable[[str], None] = lambda _: None) -> ClusterState:
        self.directory.mkdir(parents=True, exist_ok=True)
        if (self.directory / CLUSTER_FILE).exists():
            raise RuntimeError(f"a cluster is already recorded in {self.directory}: `corral cluster down` it first")
        network = ClusterNetwork.for_directory(self.directory)
        address = f"{network.address}:6379"
        postgres_dir = None
        if self._database_url is None:  # outside the cluster dir, whose parents postgres may not enter
            postgres_dir = Path(tempfile.mkdtemp(prefix="corral-cluster-pg-", dir="/var/tmp"))
        # Recorded before anything starts, so a failure part-way is undone by down() like a whole cluster.
        state = self.state = ClusterState(
            directory=str(self.directory), ray_address=address, head_session=0, gateway_pid=0, gateway_url="",
            api_key=f"ck_{secrets.token_hex(24)}", database_url=self._database_url or "",
            postgres_dir=str(postgres_dir) if postgres_dir else None, netns=network.name,
        )  # fmt: skip
        state.save()
        try:
            if postgres_dir is not None:
                progress("starting PostgreSQL")
                state.database_url = _start_postgres(postgres_dir)
            env = {**os.environ, **LOCAL_RAY_ENV}
            network.create()
            logs = self.directory / "logs"
            logs.mkdir(exist_ok=True)
            if self._forward_ports:
                progress(f"forwarding loopback ports {self._forward_ports} into the namespace")
                state.forwarder_pid = _start_forwarder(network.name, self._forward_ports, logs / "forward.log")
                state.save()
            progress(f"starting the Ray head at {address} (network namespace {network.name})")
            head = start_ray_node(
                ["--head", "--port", address.rsplit(":", 1)[1], "--node-ip-address", network.address,
                 "--num-cpus", "0", "--include-dashboard=false", "--disable-usage-stats",
                 "--object-store-memory", str(200 << 20), "--temp-dir", str(self._ray_temp_dir())],
                env, logs / "ray-head.log", namespace=False, netns=network.name,
            )  # fmt: skip
            state.head_session = head.pid
            state.save()
            _wait_for_ray(address, env, network.name)
            progress("starting the gateway")
            gateway = self._start_gateway(self.directory / "gateway")
            assert gateway.process is not None
            state.gateway_pid, state.gateway_url = gateway.process.pid, gateway.url
            state.save()
            if nodes:
                progress(f"joining {nodes} node{'s' if nodes > 1 else ''}")
                self.add_nodes({f"e{index}": {} for index in range(1, nodes + 1)})
        except BaseException:
            self.down()
            raise
        return state

    def add_node(
        self, edge_id: str, labels: dict[str, str] | None = None, settings: dict[str, str] | None = None, *,
        own_network: bool = False,
    ) -> NodeProcess:  # fmt: skip
        """Join a node; ``settings``: ``CORRAL_*`` of this node only, over the cluster's node settings.
        ``own_network``: in a network namespace of its own, as if on another machine (``cut_node`` needs it)."""
        node = self._record(self._start_node(edge_id, labels, settings, own_network))
        self._wait_until_up(edge_id)
        return node

    def remove_node(self, edge_id: str) -> None:
        """Stop a node as `corral cluster leave` does (the gateways mark it and its sandboxes lost once its
        heartbeats stop), delete what its sandboxes left on this machine and its network namespace."""
        state = self._state()
        node = state.nodes[edge_id]
        stop_session(node.session)  # kept in the state until stopped: if this raises, `down` still finds it
        delete_leftover_sandboxes(Path(node.data_dir))
        if node.netns is not None:
            self._network_of(edge_id).delete()
        del state.nodes[edge_id]
        state.save()

    def cut_node(self, edge_id: str) -> None:
        """Cut the node's network: no packet passes between it and the cluster (head, gateway, other nodes,
        the database) until ``restore_node``. Its processes run on, as on a machine behind a broken link."""
        self._node_network(edge_id).cut()

    def restore_node(self, edge_id: str) -> None:
        self._node_network(edge_id).restore()

    def _node_network(self, edge_id: str) -> NodeNetwork:
        node = self._state().nodes[edge_id]
        if node.netns is None:
            raise ValueError(f"node {edge_id} shares the cluster's network namespace: join it with own_network")
        return self._network_of(edge_id)

    def _network_of(self, edge_id: str) -> NodeNetwork:
        """The network namespace a node of its own network has (or will have) on this cluster."""
        return NodeNetwork.for_node(ClusterNetwork.for_directory(self.directory), edge_id)

    def add_nodes(self, nodes: dict[str, dict[str, str]]) -> list[NodeProcess]:
        """Join several nodes (edge id -> labels), one after another: raylets joining the same head from one
        machine at once fail to register ("Failed to get node info: Deadline Exceeded", seen here)."""
        return [self.add_node(edge_id, labels=labels) for edge_id, labels in nodes.items()]

    def _record(self, node: NodeProcess) -> NodeProcess:
        state = self._state()
        state.nodes[node.edge_id] = node
        state.save()
        return node

    def _start_node(
        self, edge_id: str, labels: dict[str, str] | None, settings: dict[str, str] | None, own_network: bool
    ) -> NodeProcess:
        """Start a node's raylet and edge actor (blocking until the actor runs; before the node heartbeats)."""
        state = self._state()
        data_dir = self.directory / "nodes" / edge_id
        node_dir = self._node_dir or data_dir / "node"
        netns, node_address, database_url = state.netns, state.ray_address.rsplit(":", 1)[0], state.database_url
        network = None
        if own_network:
            database_url = self._database_over_network()
            network = self._network_of(edge_id)
            network.create()
            netns, node_address = network.name, network.address
        env = node_env(
            edge_id=edge_id, data_dir=data_dir, node_dir=node_dir, database_url=database_url,
            gateway_url=state.gateway_url, api_key=state.api_key, labels=labels,
            extra={**LOCAL_RAY_ENV, **self._node_settings, **(settings or {})},
        )  # fmt: skip
        try:
            process, _ = join_node(
                state.ray_address, edge_id, env, self.directory / "logs", netns=netns,
                ray_args=["--node-ip-address", node_address, "--object-store-memory", str(100 << 20),
                          "--temp-dir", str(self._ray_temp_dir())],
            )  # fmt: skip
        except BaseException:
            if network is not None:
                network.delete()
            raise
        return NodeProcess(
            edge_id=edge_id, session=process.pid, data_dir=str(data_dir), labels=labels or {},
            netns=network.name if network else None,
        )  # fmt: skip

    def _database_over_network(self) -> str:
        """The state database as a node in a namespace of its own reaches it: over TCP to the cluster's address,
        where a relay (started once) offers PostgreSQL's unix socket."""
        state = self._state()
        if state.database_relay_url:
            return state.database_relay_url
        url = make_url(state.database_url)
        socket_dir = url.query.get("host")
        if not url.drivername.startswith("postgresql") or not isinstance(socket_dir, str) or url.host:
            raise ValueError(f"a node of its own network needs PostgreSQL on a unix socket, not {url!r}")
        assert state.netns is not None
        socket_path = f"{socket_dir}/.s.PGSQL.{url.port or 5432}"
        address = state.ray_address.rsplit(":", 1)[0]
        state.database_relay_pid, port = _start_relay(
            _launch("relay", state.netns, address, socket_path), self.directory / "logs" / "database-relay.log"
        )
        state.database_relay_url = url.set(host=address, port=port, query={}).render_as_string(hide_password=False)
        state.save()
        return state.database_relay_url

    def _wait_until_up(self, edge_id: str) -> None:
        deadline = time.monotonic() + NODE_UP_TIMEOUT_S
        while time.monotonic() < deadline:
            if any(n["edge_id"] == edge_id and n["state"] == "up" for n in self.cluster_nodes()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"node {edge_id} did not heartbeat within {NODE_UP_TIMEOUT_S:.0f} s")

    def _ray_temp_dir(self) -> Path:
        """Ray's session files: a short path (its unix socket paths must stay under 108 bytes)."""
        return Path("/tmp") / ClusterNetwork.for_directory(self.directory).name

    # -- inspect -----------------------------------------------------------------

    def _state(self) -> ClusterState:
        if self.state is None:
            self.state = ClusterState.load(self.directory)
        return self.state

    def running(self) -> bool:
        """Whether the recorded cluster's gateway answers."""
        try:
            state = self._state()
            return httpx.get(f"{state.gateway_url}/healthz", timeout=5).status_code == 200
        except (FileNotFoundError, httpx.TransportError):
            return False

    def cluster_nodes(self) -> list[dict[str, Any]]:
        """The gateway's view (the shared ``nodes`` table): state, last heartbeat, load."""
        state = self._state()
        response = httpx.get(
            f"{state.gateway_url}/v1/cluster/nodes", headers={"Authorization": f"Bearer {state.api_key}"}, timeout=10
        )
        response.raise_for_status()
        return list(response.json())

    def edge_pid(self, edge_id: str) -> int | None:
        """The pid of the node's edge actor worker (found in the node's session by its edge id)."""
        node = self._state().nodes[edge_id]
        for pid in _session_members(node.session):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(b"ray::EdgeActor") and f"CORRAL_EDGE_ID={edge_id}".encode() in environ:
                return pid
        return None

    def _start_gateway(self, data_dir: Path) -> EmbeddedServer:
        state = self._state()
        assert state.netns is not None
        gateway = EmbeddedServer(
            data_dir, host=state.ray_address.rsplit(":", 1)[0], launcher=_launch("netns", state.netns, "--"),
            env={**LOCAL_RAY_ENV, "CORRAL_ENGINE": "ray", "CORRAL_RAY_ADDRESS": state.ray_address,
                 "CORRAL_DATABASE_URL": state.database_url, "CORRAL_API_KEY": state.api_key,
                 **self._gateway_settings},
            stop_with_caller=False,  # the cluster's gateway outlives `corral cluster up`
        )  # fmt: skip
        gateway.start()
        return gateway

    def add_gateway(self) -> str:
        """Another gateway replica over the same cluster and state; its URL."""
        state = self._state()
        gateway = self._start_gateway(self.directory / f"gateway-{len(state.replicas) + 2}")
        assert gateway.process is not None
        state.replicas.append(gateway.process.pid)
        state.save()
        return gateway.url

    # -- down --------------------------------------------------------------------

    def down(self) -> None:
        """Kill the cluster's sandboxes, stop the gateway, the nodes, the head and PostgreSQL."""
        state = self._state()
        if state.gateway_pid:
            with contextlib.suppress(CorralError):
                with Client(state.gateway_url, state.api_key) as client:
                    for info in client.list():
                        with contextlib.suppress(CorralError):
                            client.kill(info.id)
            _stop_pid(state.gateway_pid)
        for pid in state.replicas:
            _stop_pid(pid)
        nodes = list(state.nodes.values())
        stop_sessions([node.session for node in nodes] + ([state.head_session] if state.head_session else []))
        for node in nodes:
            delete_leftover_sandboxes(Path(node.data_dir))
            if node.netns is not None:
                self._network_of(node.edge_id).delete()
        state.nodes.clear()
        state.save()
        for pid in (state.forwarder_pid, state.database_relay_pid):
            if pid:
                _stop_pid(pid)
        if state.netns:
            ClusterNetwork.for_directory(self.directory).delete()
        if state.postgres_dir:
            _stop_postgres(Path(state.postgres_dir))
            shutil.rmtree(state.postgres_dir, ignore_errors=True)
        (self.directory / CLUSTER_FILE).unlink(missing_ok=True)
        shutil.rmtree(self._ray_temp_dir(), ignore_errors=True)
        self.state = None


def _start_forwarder(netns: str, ports: list[int], log_path: Path) -> int:
    """`launch forward` in a session of its own; its pid once its listeners are bound."""
    return _start_relay(_launch("forward", netns, *map(str, ports)), log_path)[0]


def _start_relay(command: list[str], log_path: Path) -> tuple[int, int]:
    """`launch forward|relay` in a session of its own: its pid once its listeners are bound, and the port the
    relay printed (0 for a forwarder, whose ports are given)."""
    with open(log_path, "ab") as log:
        relay = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                 start_new_session=True)  # fmt: skip
    assert relay.stdout is not None
    ready = relay.stdout.readline().decode().split()  # the line comes once bound, or EOF if it failed
    relay.stdout.close()
    if not ready or ready[0] != FORWARD_READY:
        relay.wait()
        raise RuntimeError(f"{' '.join(command[3:])} failed: {log_path.read_text()[-2000:]}")
    return relay.pid, int(ready[1]) if len(ready) > 1 else 0


def _stop_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < deadline:
        fields = stat_fields(pid)
        if fields is None or _reap_if_zombie(pid, fields[0]):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _wait_for_ray(address: str, env: dict[str, str], netns: str | None, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = subprocess.run(
            _in_netns(netns, [_ray_binary(), "health-check", "--address", address]), env=env, capture_output=True,
            timeout=30,
        )  # fmt: skip
        if done.returncode == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the Ray head at {address} did not come up within {timeout_s:.0f} s")


def _start_postgres(directory: Path) -> str:
    done = subprocess.run(
        ["bash", str(_REPO / "scripts" / "postgres.sh"), "start", str(directory)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"PostgreSQL did not start: {done.stderr.strip()} (or pass --database-url)")
    return done.stdout.strip()


def _stop_postgres(directory: Path) -> None:
    subprocess.run(["bash", str(_REPO / "scripts" / "postgres.sh"), "stop", str(directory)], capture_output=True)
