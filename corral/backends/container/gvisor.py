"""What differs for gVisor (``runtime="runsc"``) container sandboxes.

gVisor runs the sandbox on its own user-space kernel (the sentry, on the
systrap platform: its kvm platform hangs on nested-PVM hosts). Three things
follow from that:

- the root filesystem is served through the sentry, so the host cannot open a
  running sandbox's files through ``/proc/<pid>/root``: files go through the
  agent as for VMs (GuestTree), running the host's static busybox, which is
  bind-mounted read-only at TOOL_PATH;
- memory and processes can be checkpointed (``runsc checkpoint``) and a new
  sandbox restored from that image (``runsc restore``);
- the host's seccomp and kernel audit do not see the sandbox's system calls
  (the sentry answers them); gVisor's own syscall surface replaces the profile.

``--overlay2=none`` keeps the writable layer on the host overlay (the default
medium leaves ``.gvisor.filestore.*`` files in the rootfs after a forced delete).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corral.backends.container.oci import AGENT_PATH

__all__ = ["BUSYBOX", "RUNSC", "RUNSC_FLAGS", "TOOL_PATH", "adapt_config", "is_gvisor"]

RUNSC = "runsc"
BUSYBOX = Path("/bin/busybox")
TOOL_PATH = "/.corral/busybox"
# Global flags, the same on every call: runsc reads its platform from them on create and restore.
RUNSC_FLAGS = ["--platform=systrap", "--overlay2=none", "--network=none"]


def is_gvisor(runtime_name: str | None) -> bool:
    return runtime_name == RUNSC


def adapt_config(config: dict[str, Any], busybox: Path = BUSYBOX) -> dict[str, Any]:
    """The crun/runc config.json made fit for runsc: the agent gets the busybox tool for file operations."""
    config["process"]["args"] = [AGENT_PATH, "--tool", TOOL_PATH]
    config["mounts"].append(
        {"destination": TOOL_PATH, "type": "bind", "source": str(busybox), "options": ["bind", "ro", "nosuid", "nodev"]}
    )
    return config
