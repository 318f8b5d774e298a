"""Guard logic without a sandbox: the repeat throttle, how changed paths are classified, detectors, and the
parsing of the kernel's seccomp audit records (the record text is what this kernel wrote)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.progress import Progress

from corral.backends.container import oci
from corral.backends.container.kernel_watch import SeccompDenials
from corral.bench.guard import DETECTOR_COMMANDS, detector_costs
from corral.guard.audit import (
    COMMAND_DETECTORS,
    CommandDetector,
    EventThrottle,
    classify_changes,
    denied_syscall_severity,
    detect_in_command,
    under,
)

RECORD = (
    'audit(1796032368.494:4): auid=0 uid=0 gid=0 ses=7 pid=30223 comm="unshare" exe="/bin/busybox" sig=0 '
    "arch=c000003e syscall=272 compat=0 ip=0x4815c7 code=0x50000"
)


def test_first_occurrence_is_due_at_once_then_one_summary_per_window() -> None:
    throttle = EventThrottle(window_s=10.0, samples=2)
    for pid in range(5):
        throttle.add("sb-1", "syscall_denied", "warning", "unshare", {"pid": pid})
    first = throttle.due(now=100.0)
    assert first == [("sb-1", "syscall_denied", "warning",
                      {"key": "unshare", "count": 5, "total": 5, "first": [{"pid": 0}, {"pid": 1}]})]  # fmt: skip
    for pid in range(1000):
        throttle.add("sb-1", "syscall_denied", "warning", "unshare", {"pid": pid})
    assert throttle.due(now=105.0) == []  # inside the window: counted, not reported
    summary = throttle.due(now=110.0)
    assert [(d["count"], d["total"], len(d["first"])) for _, _, _, d in summary] == [(1000, 1005, 2)]
    assert throttle.due(now=200.0) == []  # nothing new: nothing to report


def test_throttle_keeps_sandboxes_and_keys_apart_and_forgets() -> None:
    throttle = EventThrottle(window_s=10.0)
    throttle.add("sb-1", "syscall_denied", "warning", "mount", {})
    throttle.add("sb-1", "syscall_denied", "warning", "unshare", {})
    throttle.add("sb-2", "sensitive_path_read", "critical", "/work/hidden/a", {})
    assert sorted((s, d["key"]) for s, _, _, d in throttle.due(now=1.0)) == [
        ("sb-1", "mount"), ("sb-1", "unshare"), ("sb-2", "/work/hidden/a"),
    ]  # fmt: skip
    throttle.add("sb-1", "syscall_denied", "warning", "mount", {})
    throttle.forget("sb-1")
    assert throttle.due(now=100.0) == []


def test_new_keys_past_the_limit_share_one_entry() -> None:
    throttle = EventThrottle(window_s=10.0, max_keys=3)
    for i in range(1000):  # a sandbox opening a thousand new files under a sensitive directory
        throttle.add("sb-1", "sensitive_path_read", "critical", f"/work/hidden/{i}", {"path": f"/work/hidden/{i}"})
    throttle.add("sb-1", "sensitive_path_read", "critical", "/work/hidden/0", {})
    due = {d["key"]: d["count"] for _, _, _, d in throttle.due(now=1.0)}
    assert due == {"/work/hidden/0": 2, "/work/hidden/1": 1, "/work/hidden/2": 1, EventThrottle.OTHER_KEY: 997}


def test_changed_paths_are_classified() -> None:
    paths = ["/var/lib/dpkg/status", "/usr/lib/python3/dist-packages/x/__init__.py", "/usr/local/lib/python3.11/a",
             "/usr/bin/bash", "/work/tests/test_a.py"]  # fmt: skip
    found = {kind: (severity, detail["paths"]) for kind, severity, detail in classify_changes(paths, ("/work/tests/",))}
    assert found["packages_modified"] == ("warning", paths[:3])
    assert found["protected_path_modified"] == ("critical", ["/usr/bin/bash", "/work/tests/test_a.py"])
    assert classify_changes(["/work/notes.txt"], ("/work/tests/",)) == []


def test_prefixes() -> None:
    assert under("/work/tests", ["/work/tests/"]) and under("/work/tests/a/b", ["/work/tests"])
    assert not under("/work/testsuite", ["/work/tests/"])
    assert under("/etc/profile.d/x.sh", ["/etc/profile"])  # a prefix without a slash matches as text


def test_detectors_for_proc_walks_and_agent_probes() -> None:
    assert ("walks_proc", "warning") in detect_in_command("grep -r secret /proc 2>/dev/null")
    assert ("walks_proc", "warning") in detect_in_command("find /proc -name 'kpage*'")
    assert detect_in_command("grep MemTotal /proc/meminfo") == []
    assert detect_in_command("ls /proc") == []
    assert ("probes_agent_channel", "warning") in detect_in_command("readlink /proc/1/fd/3")
    assert detect_in_command("cat /proc/self/status") == []


def test_detectors_for_package_pins() -> None:
    for command in ("pip install 'solver==2.0'", "apt-get install -y python3-solver=2.0-1", "dpkg -i /tmp/s.deb",
                    "npm install left-pad@1.3.0"):  # fmt: skip
        assert ("package_pin_or_upgrade", "warning") in detect_in_command(command), command
    assert detect_in_command("apt-get install -y python3-numpy") == []


@pytest.mark.parametrize("detector", COMMAND_DETECTORS, ids=lambda detector: detector.kind)
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_a_command_a_detector_matches_holds_one_of_its_literals(detector: CommandDetector, data: st.DataObject) -> None:
    """The literals are a filter in front of each pattern (a scan of a long command costs ~1 ms): a command
    with a match in it (drawn from the pattern, with any text around it) must hold one of them, and be found."""
    command = data.draw(st.from_regex(detector.pattern))
    assert any(needle in command for needle in detector.needles), (detector.kind, command)
    assert (detector.kind, detector.severity) in detect_in_command(command)


def test_a_long_command_without_the_literals_is_not_scanned() -> None:
    """What the filter is for: a heredoc of a few KiB (how agents write files) with none of the literals finds
    nothing, and a literal in it with no match around it finds nothing either."""
    body = "def f(x):\n    return x + 1  # some code here with words\n" * 100
    assert detect_in_command(f"cat > /work/repo/src/mod.py <<'EOF'\n{body}EOF\n") == []
    assert detect_in_command(f"cat > /work/repo/src/test_mod.py <<'EOF'\n{body}EOF\n") == []
    assert detect_in_command(f"cat > /work/repo/tests/mod.py <<'EOF'\n{body}EOF\n") == [("modifies_tests", "warning")]


def test_seccomp_record_is_parsed_and_named() -> None:
    watch = SeccompDenials()
    try:
        record = watch._parse(RECORD)
    finally:
        watch.close()
    assert record is not None
    assert (record.session, record.pid, record.syscall, record.comm, record.exe) == (
        7, 30223, "unshare", "unshare", "/bin/busybox",
    )  # fmt: skip
    assert denied_syscall_severity("ioctl") == "critical" and denied_syscall_severity("unshare") == "warning"


def test_profile_logs_refusals_and_refuses_extent_swaps_on_32_bits() -> None:
    assert oci._seccomp(log_denials=True)["flags"] == ["SECCOMP_FILTER_FLAG_LOG"]
    assert "flags" not in oci._seccomp(log_denials=False)  # runc 1.1 refuses any flag
    ioctl_rules = [rule for rule in oci._seccomp(log_denials=True)["syscalls"] if rule["names"] == ["ioctl"]]
    requests = {rule["args"][0]["valueTwo"] for rule in ioctl_rules}
    assert requests == set(oci.DENIED_IOCTLS.values())
    assert all(rule["args"][0]["op"] == "SCMP_CMP_MASKED_EQ" and rule["args"][0]["value"] == 0xFFFFFFFF
               for rule in ioctl_rules)  # fmt: skip
    clone_rules = [rule for rule in oci._seccomp(log_denials=True)["syscalls"] if rule["names"] == ["clone"]]
    assert {(r["args"][0]["value"], r["args"][0]["valueTwo"]) for r in clone_rules} == {
        (flag, flag) for flag in oci.CLONE_NAMESPACE_FLAGS.values()
    }  # any one namespace bit set is refused
    assert not any("clone3" in rule["names"] for rule in oci._seccomp(log_denials=True)["syscalls"])  # launch's


def test_the_guard_bench_times_the_detectors_against_the_patterns_alone() -> None:
    """`corral bench guard`'s detector rows: each command's size and findings, both sides timed (no server)."""
    costs = detector_costs(Progress(), rounds=2)
    assert list(costs) == list(DETECTOR_COMMANDS)
    for label, cost in costs.items():
        assert cost["bytes"] == len(DETECTOR_COMMANDS[label]) and cost["found"] == []
        assert cost["detectors"]["n"] == cost["patterns_alone"]["n"] == 2
        assert cost["detectors"]["p50"] > 0 and cost["patterns_alone"]["p50"] > 0
