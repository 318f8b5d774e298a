"""The kernel-log check the attack tests end with (tests/kernel_log.py): the host kernel's one known debug
warning (file-backed EROFS over ext4 on a CONFIG_EXT4_DEBUG kernel) is set aside, anything else is reported.
The messages are this host's own, as /dev/kmsg gave them during a full run (call trace trimmed)."""

from __future__ import annotations

from tests.kernel_log import TAINT_WARN, judge, split_reports

KNOWN = [
    "------------[ cut here ]------------",
    "WARNING: CPU: 1 PID: 26824 at fs/ext4/inode.c:460 ext4_check_map_extents_env+0xbc/0xd0",
    "CPU: 1 UID: 0 PID: 26824 Comm: dpkg-deb Not tainted 6.18.44-fc-v1045 #1 PREEMPT(none) ",
    "RIP: 0010:ext4_check_map_extents_env+0xbc/0xd0",
    "Call Trace:",
    " <TASK>",
    " ext4_map_blocks+0x2d4/0x5a0",
    " ext4_mpage_readpages+0x3b0/0x690",
    " filemap_read_folio+0x3e/0x100",
    " do_read_cache_folio+0x9e/0x490",
    " erofs_bread+0xad/0x190",
    " erofs_read_inode+0xf7/0x720",
    " ovl_lookup+0x8e3/0x1150",
    " </TASK>",
    "---[ end trace 0000000000000000 ]---",
]
OTHER = [
    "------------[ cut here ]------------",
    "WARNING: CPU: 0 PID: 4242 at mm/page_alloc.c:4700 __alloc_pages_noprof+0x2f1/0x330",
    "Call Trace:",
    " kmalloc_large+0x20/0x80",
    "---[ end trace 0000000000000000 ]---",
]
AROUND = ["erofs (device erofs): mounted with root inode @ nid 36.", "br0: port 1(cx0015476163) entered blocking state"]


def test_the_known_ext4_debug_warning_is_one_report_and_set_aside() -> None:
    reports = split_reports(AROUND + KNOWN + AROUND)
    assert len(reports) == 1 and reports[0].startswith("------------[ cut here ]") and "erofs_bread" in reports[0]
    assert judge(reports, TAINT_WARN) == []


def test_any_other_warning_is_reported_with_its_text() -> None:
    problems = judge(split_reports(KNOWN + AROUND + OTHER), TAINT_WARN)
    assert len(problems) == 1 and "__alloc_pages_noprof" in problems[0] and "ext4_check" not in problems[0]


def test_new_taint_flags_without_a_report_are_problems() -> None:
    assert judge([], TAINT_WARN) == ["TAINT_WARN set, and no warning report found in the kernel log"]
    assert judge(split_reports(KNOWN), TAINT_WARN | 1 << 12) == ["new taint flags 0x1000 (/proc/sys/kernel/tainted)"]
    assert judge([], 0) == []
