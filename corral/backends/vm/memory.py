"""Kernel samepage merging for VM guests whose RAM is mergeable (``CORRAL_VM_MEMORY=mergeable``).

Idle guests booted from the same kernel and layers hold many identical pages
(kernel text, page cache of the same files); KSM keeps one copy. It is a
host-wide switch, so the server turns it on only when asked, and reports what
it merges in the node stats.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["KSM_DIR", "ensure_ksm", "ksm_merged_bytes"]

KSM_DIR = Path("/sys/kernel/mm/ksm")
PAGES_TO_SCAN = 1000  # per wake-up (every 20 ms by default): about 200 MB/s scanned at most
_PAGE = 4096


def ensure_ksm(ksm_dir: Path = KSM_DIR) -> str:
    """Turn KSM on (if off) with a scan rate that merges a new guest within seconds; says what it did."""
    run = ksm_dir / "run"
    if not run.exists():
        return "KSM: this kernel has none; mergeable guest memory will not be merged"
    if run.read_text().strip() == "1":
        return "KSM: already on"
    (ksm_dir / "pages_to_scan").write_text(str(PAGES_TO_SCAN))
    run.write_text("1")
    return f"KSM: turned on ({PAGES_TO_SCAN} pages per scan) for mergeable VM memory"


def ksm_merged_bytes(ksm_dir: Path = KSM_DIR) -> int:
    """Memory KSM saves now: pages that point at a shared copy instead of their own."""
    try:
        return int((ksm_dir / "pages_sharing").read_text()) * _PAGE
    except (OSError, ValueError):
        return 0
