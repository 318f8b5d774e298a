"""A throwaway `corral serve` subprocess: for the demo, the benchmark and the tests.

It runs on a free loopback port with a data dir of its own, in a session of
its own (Ctrl-C reaches the caller, which can still clean up), and on stop
kills its sandboxes, stops the server (SIGTERM, a grace period, SIGKILL) and
deletes any container that outlived it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

from corral.backends.common.host import detect_cgroup_layout, run_dir_of, runtime_state_root
from corral.backends.common.network import clear_stale_name
from corral.backends.vm.cgroup import KILLED_QEMU_EXIT_S, VmCgroup
from corral.backends.vm.network import namespace_name
from corral.config import Settings
from corral.sdk import Client, CorralError

__all__ = ["EmbeddedServer", "delete_leftover_sandboxes", "free_port", "linked_node_dir"]

START_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0
RUNTIME_TIMEOUT_S = 30.0
_IDS_SHOWN = 5  # sandbox ids named in the line about leftovers


def linked_node_dir(node_dir: Path, parts: tuple[str, ...] = ("layers", "bin", "vm")) -> Path:
    """A node dir of its own whose layer store and compiled helpers hard-link the real node dir's files.

    They are read-only and named by their digest, so sharing them is safe, and whatever a throwaway
    server builds lands here and goes away with it. ``parts``: which of them (``("bin",)`` is a node
    that has never seen a layer but need not compile its helpers again).
    """
    real = Settings().node_dir
    for sub in parts:
        source = real / sub
        for path in source.rglob("*") if source.is_dir() else []:
            target = node_dir / sub / path.relative_to(source)
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
    return node_dir


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def delete_leftover_sandboxes(data_dir: Path) -> None:
    """Containers and VMs of a server (or cluster node) with this data dir that outlived it, said in one line:
    a warm pool's sandboxes (a stopping server leaves them for its restart) or creates it stopped in."""
    containers = _delete_leftover_containers(data_dir)
    vms = _kill_leftover_vms(data_dir)
    shutil.rmtree(run_dir_of(data_dir), ignore_errors=True)  # their runtime state and bundles, on the host's tmpfs
    if containers or vms:
        ids = [*containers, *vms]
        shown = ", ".join(ids[:_IDS_SHOWN]) + (f" and {len(ids) - _IDS_SHOWN} more" if len(ids) > _IDS_SHOWN else "")
        _tell(f"deleted {len(containers)} container(s) and {len(vms)} VM(s) that outlived their server "
              f"({data_dir}; a warm pool's, or creates it stopped in): {shown}")  # fmt: skip


def _tell(line: str) -> None:
    """A line on stderr that cannot stop a cleanup: a closed stderr (a bench piped into `head`) is ignored."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _kill_leftover_vms(data_dir: Path) -> list[str]:
    """QEMU processes of the VM sandboxes that outlived their server (a create still booting when it
    stopped, a warm pool's guests): by their pid files, checked against the process's name, with their guest
    memory files, their cgroups (which outlive the process: the kernel keeps an empty cgroup until removed), their
    namespaces' names and their directories."""
    layout = detect_cgroup_layout()
    killed = []
    for machine_dir in sorted(path for path in (data_dir / "vms").glob("*") if path.is_dir()):
        sandbox_id = machine_dir.name
        try:
            pid = int((machine_dir / "qemu.pid").read_text().strip())
            if f"corral-{sandbox_id}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
                killed.append(sandbox_id)
        except (OSError, ValueError):
            pass
        Path(f"/dev/shm/corral-{sandbox_id}.mem").unlink(missing_ok=True)
        VmCgroup(layout, sandbox_id).remove(KILLED_QEMU_EXIT_S)
        # Its namespace's name was a mount in the server's own mount namespace: here, only its empty file is left.
        clear_stale_name(f"/run/netns/{namespace_name(sandbox_id)}")
        shutil.rmtree(machine_dir, ignore_errors=True)  # its disk: a full VM's holds a whole system
    return killed


def _delete_leftover_containers(data_dir: Path) -> list[str]:
    deleted = []
    for runtime in ("crun", "runc", "runsc"):
        state_root = runtime_state_root(data_dir, runtime)
        binary = shutil.which(runtime)
        if binary is None or not state_root.is_dir():
            continue
        command = [binary, "--root", str(state_root)]
        listing = subprocess.run(
            [*command, "list", "--quiet"], capture_output=True, text=True, timeout=RUNTIME_TIMEOUT_S
        )
        for container_id in listing.stdout.split():
            subprocess.run(
                [*command, "delete", "--force", container_id], capture_output=True, timeout=RUNTIME_TIMEOUT_S
            )
            deleted.append(container_id)
    return deleted


class EmbeddedServer:
    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        launcher: list[str] | None = None,
        stop_with_caller: bool = True,
    ) -> None:
        """``host``: the address it listens on; ``launcher``: a command that runs it (e.g. in a network namespace);
        ``stop_with_caller``: when this process ends, even by SIGKILL, the server kills its sandboxes and stops
        (Settings.stop_with_pid); off for servers meant to outlive their caller (`corral cluster`'s)."""
        self.data_dir = data_dir
        self.host = host
        self._launcher = launcher or []
        self.port = port or free_port()
        self.log_path = data_dir / "server.log"
        self._extra_env = env or {}
        self.process: subprocess.Popen[bytes] | None = None
        self._stop_with_caller = stop_with_caller

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.data_dir / "client.json"

    @property
    def api_key(self) -> str:
        return str(json.loads(self.config_file.read_text())["api_key"])

    def env(self) -> dict[str, str]:
        """The environment that points the server, the SDK and the CLI at this server."""
        return {
            **os.environ,
            "CORRAL_DATA_DIR": str(self.data_dir),
            "CORRAL_HOST": self.host,
            "CORRAL_PORT": str(self.port),
            "CORRAL_CONFIG_FILE": str(self.config_file),
            **self._extra_env,
        }

    def client(self) -> Client:
        return Client(self.url, self.api_key)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = self.env()
        env.pop("CORRAL_STOP_WITH_PID", None)  # a caller's own (it may be such a server's child): not for this one
        if self._stop_with_caller:
            env["CORRAL_STOP_WITH_PID"] = str(os.getpid())
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*self._launcher, sys.executable, "-m", "corral.cli.main", "serve"],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                problem = (
                    f"exited ({self.process.returncode})" if self.process.returncode is not None else "did not answer"
                )
                tail = self.log_path.read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"corral serve {problem} within {timeout_s:.0f} s; its log ends:\n{tail}")
            time.sleep(0.05)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill_all_sandboxes(self) -> None:
        if not self.running():
            return
        try:
            with self.client() as client:
                for info in client.list():
                    try:
                        client.kill(info.id)
                    except CorralError:
                        pass
        except CorralError:
            pass

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server only; its sandboxes keep running (a restart adopts them)."""
        if not self.running():
            return
        assert self.process is not None
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def shutdown(self) -> None:
        """Kill the sandboxes, stop the server, delete any container that outlived it."""
        try:
            self.kill_all_sandboxes()
        finally:
            self.stop()
            delete_leftover_sandboxes(self.data_dir)

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.shutdown()
