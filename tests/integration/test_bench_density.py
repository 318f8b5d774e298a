"""`corral bench density` at a tiny size (4 sandboxes in 2 steps), so that the benchmark cannot rot: it runs as its
own process, as users run it, with its own server."""

from __future__ import annotations

from tests.conftest import bench_report


def test_bench_density_reports_memory_the_shrinker_slab_and_a_sandboxs_superblocks() -> None:
    (report,) = bench_report("density", "--count", "4", "--step", "2", "--idle-window-s", "1")["runs"]
    assert [step["sandboxes"] for step in report["steps"]] == [0, 2, 4]
    assert all(step["one_kib_slab_mib"] > 0 and step["exec"] for step in report["steps"][1:])
    # Starting a container is work for the kernel and for user space. /proc/stat counts in ticks of 10 ms, sampled
    # (a tick the hypervisor took counts as steal): a step of two creates on a busy machine counted no system tick
    # once, no user tick another time, so each step reports both and the run as a whole must have counted some.
    creates = [step["create"] for step in report["steps"][1:]]
    kinds = ("host_user_ms_per_create", "host_system_ms_per_create")
    assert all(create[kind] >= 0 for create in creates for kind in kinds)
    assert sum(create[kind] for create in creates for kind in kinds) > 0
    # What each sandbox adds to the node's shrinkers (docs/spec.md, Density): five, the sysfs and /dev/shm shared.
    assert report["superblocks_of_its_own"] == ["devpts", "mqueue", "overlay", "proc", "tmpfs"]
    assert report["kill"]["killed"] == 4 and not report["kill"]["failed"]
    assert not any(report["leftovers"].values()), report["leftovers"]
    assert all(step["server_idle_cpu_percent"] >= 0 for step in report["steps"])


def test_bench_density_with_networked_sandboxes_reports_the_servers_idle_cpu() -> None:
    (report,) = bench_report("density", "--count", "2", "--step", "2", "--network", "--idle-window-s", "6")["runs"]
    assert report["network"] is True and [step["sandboxes"] for step in report["steps"]] == [0, 2]
    # A networked sandbox mounts a sysfs of its own (its interface's); a loopback-only one shares the node's.
    assert "sysfs" in report["superblocks_of_its_own"]
    # Over 6 s the server ran its housekeeping (a round a second) and, at 2, listed each sandbox's counters.
    assert all(step["server_idle_cpu_percent"] > 0 for step in report["steps"])
    assert report["kill"]["killed"] == 2 and not report["leftovers"]["veths"] and not any(report["leftovers"].values())
