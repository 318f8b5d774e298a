"""One node's edge, built from the settings: the same for `corral serve` and for a Ray cluster's edge actor.

``prepare_host`` does the per-process host setup (a private mount namespace
unless the caller's process tree already has one, child subreaper, compiled
helpers, zram, KSM); ``build_edge`` assembles the backends, the admission
capacity and the ``LocalEdge`` over them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from corral.backends.common.host import (
    RUN_ROOT,
    CgroupLayout,
    NativeHelpers,
    become_child_subreaper,
    build_native_helpers,
    detect_cgroup_layout,
    ensure_run_tmpfs,
    enter_private_mount_namespace,
    raise_open_files_limit,
)
from corral.backends.common.network import HostResolver
from corral.backends.container.backend import ContainerBackend
from corral.backends.container.memory import ensure_zram_swap
from corral.backends.router import BackendRouter
from corral.backends.vm.backend import VmBackend
from corral.backends.vm.memory import ensure_ksm
from corral.config import Settings
from corral.edge.local import LocalEdge, node_capacity
from corral.edge.protocol import EdgeEvents

__all__ = ["HostSetup", "PRIVATE_MOUNT_NS_ENV", "prepare_host", "build_edge"]

log = logging.getLogger("corral")

PRIVATE_MOUNT_NS_ENV = "CORRAL_PRIVATE_MOUNT_NS"
# The writable layers' pool is sized to leave floor / 2 of the data disk free however much sandboxes write:
# creates stop at the floor, and the half below it is the state database's, the trajectory log's and the
# layer cache's (docs/architecture.md, "Free-space floor").
DISK_RESERVE_FRACTION_OF_FLOOR = 2
"""Set by the process that entered the private mount namespace, to its id (``mnt:[...]``), for its children
(a Ray raylet and its workers, which are multi-threaded and cannot unshare one of their own)."""


@dataclass(frozen=True)
class HostSetup:
    layout: CgroupLayout
    helpers: NativeHelpers


def _own_mount_namespace() -> str:
    return os.readlink("/proc/self/ns/mnt")


def enter_node_namespace() -> CgroupLayout:
    """Enter a private mount namespace and say so to child processes (call before any thread starts). The node's
    run directory's tmpfs is mounted first, in the host's namespace, where the next server finds it."""
    layout = detect_cgroup_layout()
    if ensure_run_tmpfs():
        log.info("mounted a tmpfs at %s for the runtime's state (this host's /run is on disk)", RUN_ROOT)
    enter_private_mount_namespace(layout)
    os.environ[PRIVATE_MOUNT_NS_ENV] = _own_mount_namespace()
    return layout


def prepare_host(settings: Settings, *, inherited_namespace: bool = False) -> HostSetup:
    """Host setup for a process that runs an edge. ``inherited_namespace``: the process is multi-threaded
    (a Ray worker) and must already be in the private mount namespace its launcher entered."""
    if os.geteuid() != 0:
        raise SystemExit("a Corral node needs root: it creates namespaces, cgroups and mounts")
    if inherited_namespace:
        if os.environ.get(PRIVATE_MOUNT_NS_ENV) != _own_mount_namespace():
            raise RuntimeError(
                "this process is not in a Corral node's private mount namespace: start the Ray node with "
                "`corral cluster up` or `corral cluster join` (they enter one before `ray start`)"
            )
        layout = detect_cgroup_layout()
    else:
        layout = enter_node_namespace()
    become_child_subreaper()
    open_files = raise_open_files_limit()
    if open_files < settings.sandbox_open_files:
        log.warning(
            "RLIMIT_NOFILE of this node is %d: sandboxes get that, not %d", open_files, settings.sandbox_open_files
        )
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    helpers = build_native_helpers(settings.node_dir)
    log.info(ensure_zram_swap(settings.pause_swap_mb))
    if settings.vm_memory == "mergeable":
        log.info(ensure_ksm())
    return HostSetup(layout, helpers)


def build_edge(settings: Settings, host: HostSetup, events: EdgeEvents) -> LocalEdge:
    """This node's edge over its container, microvm and vm backends."""
    containers = ContainerBackend(
        data_dir=settings.data_dir,
        helpers=host.helpers,
        layout=host.layout,
        default_runtime=settings.runtime,
        agent_start_timeout_s=settings.agent_start_timeout_s,
        layer_idle_unmount_s=settings.layer_idle_unmount_s,
        create_concurrency=settings.create_concurrency,
        destroy_concurrency=settings.destroy_concurrency,
        audit_repeat_window_s=settings.audit_repeat_window_s,
        default_disk_mb=settings.sandbox_disk_mb,
        disk_reserve_mb=settings.disk_floor_mb // DISK_RESERVE_FRACTION_OF_FLOOR,
        open_files=settings.sandbox_open_files,
        resolver=HostResolver(settings.network_hosts_file),
        resolve_interval_s=settings.network_resolve_interval_s,
    )
    backend = BackendRouter(
        [
            containers,
            *(
                VmBackend(
                    kind=kind,
                    data_dir=settings.data_dir,
                    node_dir=settings.node_dir,
                    guest_agent=host.helpers.agent,
                    accel=settings.vm_accel,
                    memory=settings.vm_memory,
                    templates=settings.vm_templates,
                    boot_timeout_s=settings.vm_boot_timeout_s,
                    network_fabric=containers.network_fabric,
                    cgroup_layout=host.layout,
                )
                for kind in ("microvm", "vm")
            ),
        ]
    )
    capacity = node_capacity(
        settings.cpu_overcommit, settings.memory_overcommit, settings.max_file_bytes,
        memory_reserve_mb=settings.memory_reserve_mb, memory_full_pressure_pct=settings.memory_full_pressure_pct,
        pressure_pause_idle_s=settings.pressure_pause_idle_s, labels=settings.node_labels,
        disk_floor_mb=settings.disk_floor_mb, data_dir=settings.data_dir,
        output_buffer_bytes=settings.sandbox_output_buffer_mb << 20,
    )  # fmt: skip
    return LocalEdge(settings.edge_id, backend, capacity, events, adopt_concurrency=settings.adopt_concurrency)
