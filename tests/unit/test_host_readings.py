"""Node readings from /proc and the admission rule built on them."""

from __future__ import annotations

from pathlib import Path

from corral.edge.host_readings import HostReadings, read_host
from corral.edge.local import NodeCapacity, pressure_refusal


def _fake_proc(root: Path, *, available_kb: int, memory_full: float, psi: bool = True) -> Path:
    root.mkdir()
    (root / "meminfo").write_text(
        f"MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   {available_kb} kB\n"
        "SwapTotal:       4194300 kB\nSwapFree:        3145724 kB\n"
    )
    (root / "loadavg").write_text("1.50 1.00 0.50 2/300 12345\n")
    if psi:
        (root / "pressure").mkdir()
        (root / "pressure" / "cpu").write_text("some avg10=12.50 avg60=1.00 avg300=0.00 total=1\n")
        (root / "pressure" / "memory").write_text(
            f"some avg10=3.00 avg60=0.00 avg300=0.00 total=1\nfull avg10={memory_full:.2f} avg60=0 avg300=0 total=1\n"
        )
        (root / "pressure" / "io").write_text(
            "some avg10=0.25 avg60=0 avg300=0 total=1\nfull avg10=0 avg60=0 total=0\n"
        )
    return root


def test_readings_parse_meminfo_swap_load_and_psi(tmp_path: Path) -> None:
    host = read_host(_fake_proc(tmp_path / "proc", available_kb=2048 * 1024, memory_full=1.5))
    assert (host.memory_total_mb, host.memory_available_mb) == (23437, 2048)
    assert (host.swap_total_mb, host.swap_used_mb) == (4095, 1024)
    assert host.load_1m == 1.5
    assert (host.cpu_some_avg10, host.memory_some_avg10, host.memory_full_avg10, host.io_some_avg10) == (
        12.5, 3.0, 1.5, 0.25,
    )  # fmt: skip


def test_a_kernel_without_psi_reads_as_no_pressure(tmp_path: Path) -> None:
    host = read_host(_fake_proc(tmp_path / "proc", available_kb=1 << 20, memory_full=0, psi=False))
    assert host.memory_full_avg10 == host.cpu_some_avg10 == 0.0


def test_the_real_host_reads() -> None:
    host = read_host()
    assert host.memory_total_mb > 0 and 0 < host.memory_available_mb <= host.memory_total_mb


def _host(available_mb: int, memory_full: float = 0.0) -> HostReadings:
    return HostReadings(24000, available_mb, 0, 0, 0.0, 0.0, 0.0, memory_full, 0.0)


def test_admission_refuses_when_memory_is_short_or_the_node_thrashes() -> None:
    cap = NodeCapacity(2.0, 24000, 64.0, 4.0, 1 << 20, memory_reserve_mb=1024, memory_full_pressure_pct=10.0)
    assert pressure_refusal(cap, _host(8000)) is None
    assert "memory is short: 512 MiB available" in (pressure_refusal(cap, _host(512)) or "")
    assert "thrashing" in (pressure_refusal(cap, _host(8000, memory_full=25.0)) or "")
