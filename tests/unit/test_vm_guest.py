"""The VM backend's pure logic: kernel extraction, module order, command lines, guest output parsing."""

from __future__ import annotations

import lzma
import mmap
import os
from pathlib import Path

import pytest

from corral.api.errors import InternalError
from corral.backends.common.guest_tree import _parse_stat
from corral.backends.common.host import run_dir_of
from corral.backends.vm.backend import VmBackend, _fill, _parse_stamp, _sized_like
from corral.backends.vm.guest import GuestKitError, extract_vmlinux, module_closure
from corral.backends.vm.qemu import Machine, MachineConfig, kernel_command_line, machine_argv, timing_arguments


def test_extract_vmlinux_finds_the_xz_elf_after_a_decompressor_stub() -> None:
    kernel = b"\x7fELF" + bytes(range(256)) * 64
    # A decoy xz stream that is not an ELF comes first, as the setup code may contain the magic.
    image = b"MZ-setup" + lzma.compress(b"not a kernel", format=lzma.FORMAT_XZ) + b"pad" * 10
    image += lzma.compress(kernel, format=lzma.FORMAT_XZ) + b"\0" * 100
    assert extract_vmlinux(image) == kernel


def test_extract_vmlinux_without_a_kernel_is_a_clear_error() -> None:
    with pytest.raises(GuestKitError, match="no xz-compressed ELF"):
        extract_vmlinux(b"MZ" + b"\0" * 4096)


MODULES_DEP = """\
kernel/fs/ext4/ext4.ko: kernel/fs/jbd2/jbd2.ko kernel/fs/mbcache.ko kernel/lib/crc16.ko
kernel/fs/jbd2/jbd2.ko:
kernel/fs/mbcache.ko:
kernel/lib/crc16.ko:
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_ring.ko:
kernel/crypto/crc32c_generic.ko:
"""


def test_module_closure_loads_each_module_after_what_it_needs() -> None:
    order = module_closure(MODULES_DEP, ("virtio_blk", "ext4", "crc32c-generic"))
    names = [Path(p).stem for p in order]
    assert names.index("virtio_ring") < names.index("virtio") < names.index("virtio_blk")
    assert {"jbd2", "mbcache", "crc16"} <= set(names[: names.index("ext4")])
    assert len(names) == len(set(names)) == 8


def test_module_closure_names_a_missing_module() -> None:
    with pytest.raises(GuestKitError, match="no module erofs"):
        module_closure(MODULES_DEP, ("erofs",))


def _config(kind: str, **extra: object) -> MachineConfig:
    return MachineConfig(
        name="sb-e0-1", kind=kind, accel="tcg", vcpus=2, memory_mb=256, kernel="/k", initramfs="/i",
        layers=("/l0.erofs", "/l1.erofs") if kind == "microvm" else (), disk="/d.qcow2", hostname="h",
        **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def test_microvm_command_line_shares_layers_read_only_and_memory_in_a_file(tmp_path: Path) -> None:
    argv = machine_argv(_config("microvm", tsc_khz=2_000_000), tmp_path, tmp_path / "sockets")
    joined = " ".join(argv)
    assert "microvm" in argv[argv.index("-M") + 1]
    assert joined.count("readonly=on") == 2 and "serial=l0" in joined and "serial=l1" in joined
    assert "virtio-blk-device,drive=disk,serial=scratch" in joined
    assert "mem-path=/dev/shm/corral-sb-e0-1.mem,share=on" in joined
    assert "name=corral.agent" in joined and "-nodefaults" in argv and "-incoming" not in argv
    assert f"path={tmp_path}/sockets/agent.sock," in joined and f"unix:{tmp_path}/sockets/qmp.sock," in joined
    append = argv[argv.index("-append") + 1]
    assert "corral.layers=2" in append and "tsc_early_khz=2000000" in append
    assert "-incoming" in machine_argv(_config("microvm"), tmp_path, tmp_path, incoming=True)


def test_full_vm_boots_its_root_disk_on_pci(tmp_path: Path) -> None:
    argv = machine_argv(_config("vm"), tmp_path, tmp_path)
    assert argv[argv.index("-M") + 1].startswith("q35")
    assert "virtio-blk-pci,drive=disk,serial=root" in " ".join(argv)
    assert "corral.root=disk" in kernel_command_line(_config("vm"))
    assert timing_arguments(None) == []


def test_machine_config_round_trips(tmp_path: Path) -> None:
    config = _config("microvm", tsc_khz=1)
    config.save(tmp_path)
    assert MachineConfig.load(tmp_path) == config


def test_guest_stat_lines_parse() -> None:
    info = _parse_stat("81a4|5|1796032704|1000|1000|a b.txt", "/w/a b.txt")
    assert (info.type, info.size, info.mode, info.uid, info.name) == ("file", 5, 0o644, 1000, "a b.txt")
    assert _parse_stat("a1ff|7|0|0|0|sh", "/bin/sh").type == "symlink"
    assert _parse_stat("41ed|4096|0|0|0|d", "/d").type == "dir"


def test_guest_time_stamps_keep_nanoseconds() -> None:
    assert _parse_stamp("1796032704|2026-11-30 10:00:00.123456789 +0000") == pytest.approx(1796032704.123456789)
    assert _parse_stamp("garbage") == 0.0


def test_a_vms_sockets_are_in_the_run_dir_however_deep_its_data_dir(tmp_path: Path) -> None:
    """QEMU refuses a unix socket path over 107 bytes with a message about a socket nobody asked for (seen with
    pytest's default deep temp dirs, when the sockets were beside the VM's disk): they are in the node's short run
    dir now, and a machine an older server started keeps its own (adoption finds them)."""
    data_dir = tmp_path / ("d" * 120)
    backend = VmBackend(kind="microvm", data_dir=data_dir, node_dir=tmp_path, guest_agent=tmp_path / "agent")
    sockets = backend._sockets("sb-e0-0123456789abcdef")
    assert sockets == run_dir_of(data_dir) / "vms" / "sb-e0-0123456789abcdef"
    assert len(os.fsencode(sockets / "agent.sock")) <= 107 < len(os.fsencode(data_dir))
    assert backend._sockets_of_existing("sb-e0-0123456789abcdef") == sockets
    older = data_dir / "vms" / "sb-e0-0123456789abcdef"
    older.mkdir(parents=True)
    (older / "qmp.sock").touch()
    assert backend._sockets_of_existing("sb-e0-0123456789abcdef") == older


async def test_sockets_too_long_for_qemu_are_a_clear_error_before_it_starts(tmp_path: Path) -> None:
    directory, sockets = tmp_path / "vm", tmp_path / ("s" * 100)
    directory.mkdir()
    config = MachineConfig(name="sb-e0-0123456789abcdef", kind="microvm", accel="tcg", vcpus=1, memory_mb=64,
                           kernel="k", initramfs="i", layers=(), disk="d", hostname="h")  # fmt: skip
    with pytest.raises(InternalError, match="over the 107 a unix socket's path may have"):
        await Machine(config, directory, sockets).launch()
    assert list(directory.iterdir()) == [] and not sockets.exists()  # nothing written, nothing started


def test_a_memory_file_mapped_before_its_copy_sees_the_data_and_keeps_its_holes(tmp_path: Path) -> None:
    """A restore starts QEMU (which maps the guest's memory file) while the template's memory is copied in:
    the file exists at full size first and the copy writes into that same file, data extents only."""
    source, dest = tmp_path / "memory", tmp_path / "copy"
    size, extents = 64 << 20, {0: b"a" * 4096, 8 << 20: os.urandom(3 << 20), (64 << 20) - 4096: b"z" * 4096}
    with open(source, "wb") as handle:
        handle.truncate(size)
        for offset, data in extents.items():
            handle.seek(offset)
            handle.write(data)
    pending = _sized_like(source, dest)
    with open(dest, "r+b") as handle, mmap.mmap(handle.fileno(), size) as mapped:  # as QEMU maps it, before
        assert os.stat(dest).st_size == size
        _fill(pending)
        for offset, data in extents.items():
            assert mapped[offset : offset + len(data)] == data
        assert mapped[4096 : 8 << 20] == bytes((8 << 20) - 4096)
    assert dest.read_bytes() == source.read_bytes()
    assert os.stat(dest).st_blocks * 512 <= os.stat(source).st_blocks * 512 + (1 << 20)  # holes stayed holes
