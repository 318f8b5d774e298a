#!/usr/bin/env bash
# Run the README's two commands on a new Debian 12 machine made on this one, as a new user would.
#
#   scripts/fresh-machine.sh [--keep] [DIR]     (root; DIR default /var/tmp/corral-fresh-machine)
#
# The machine is `debootstrap --variant=minbase bookworm` plus make and python3 (what every machine of this
# kind starts with), and a clone of this repo's HEAD in /root/corral. It gets a root of its own with pivot_root
# (not chroot: the kernel refuses user namespaces, which gVisor needs, inside a chroot) in a private mount
# namespace and a PID namespace, so its mounts and processes vanish with it; it shares this machine's kernel,
# network and cgroups. It then runs
# `make demo` (timed), `make demo` again, `scripts/setup.sh --check` and `make test`, and prints the times.
# Without --keep the machine is made anew; with it, a machine left by an earlier run is reused (its packages,
# venv and images are already there, so only a clean clone of HEAD is new).
#
# It copies what the host has and Corral does not install: the CA certificates in /usr/local/share/ca-certificates
# (e.g. an egress proxy's), /etc/pip.conf and /etc/apt/apt.conf.d/99*, and /opt (bound, for local wheels).
set -euo pipefail

KEEP=0
if [[ "${1:-}" == "--keep" ]]; then KEEP=1; shift; fi
ROOT="${1:-/var/tmp/corral-fresh-machine}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ $EUID -eq 0 ]] || { echo "fresh-machine: run as root" >&2; exit 1; }

if ((!KEEP)) || [[ ! -x "$ROOT/usr/bin/make" ]]; then
    rm -rf "$ROOT"
    mirror="$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)"
    echo "fresh-machine: debootstrap bookworm into $ROOT (about a minute)"
    debootstrap --variant=minbase --include=make,python3,ca-certificates bookworm "$ROOT" \
        "${mirror:-http://deb.debian.org/debian}" >"$ROOT.debootstrap.log" 2>&1 \
        || { echo "fresh-machine: debootstrap failed; see $ROOT.debootstrap.log" >&2; exit 1; }
    cp /etc/apt/sources.list.d/*.sources "$ROOT/etc/apt/sources.list.d/" 2>/dev/null && rm -f "$ROOT/etc/apt/sources.list"
fi
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/" 2>/dev/null || true
cp /etc/pip.conf "$ROOT/etc/pip.conf" 2>/dev/null || true
cp /etc/apt/apt.conf.d/99* "$ROOT/etc/apt/apt.conf.d/" 2>/dev/null || true
chroot "$ROOT" update-ca-certificates >/dev/null 2>&1
rm -rf "$ROOT/root/corral" "$ROOT/tmp/pytest-of-root"
git clone -q "$REPO_ROOT" "$ROOT/root/corral"
echo "fresh-machine: $(git -C "$ROOT/root/corral" log --oneline -1)"

# shellcheck disable=SC2016  # expanded by the machine's shell
RUN='cd /root/corral
t0=$(date +%s); make demo; rc=$?; t1=$(date +%s)
echo "fresh-machine: first make demo: exit $rc in $((t1 - t0)) s"
make demo >/tmp/second-demo.log 2>&1; rc=$?; t2=$(date +%s)
echo "fresh-machine: second make demo: exit $rc in $((t2 - t1)) s"
bash scripts/setup.sh --check
make test; rc=$?; t3=$(date +%s)
echo "fresh-machine: make test: exit $rc in $((t3 - t2)) s"
exit $rc'
# A PID namespace of its own too: when its first process ends (or this script is killed), the kernel ends every
# process the machine started, servers and sandboxes included.
exec unshare --mount --propagation private --pid --fork --kill-child bash -c '
    set -e
    root="$1"
    mount --bind "$root" "$root"   # a machine'"'"'s / is a mount point (the server makes it private)
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys"
    mount --rbind /dev "$root/dev"
    mount -t tmpfs tmpfs "$root/run"
    mkdir -p "$root/opt" && mount --rbind /opt "$root/opt"
    cd "$root" && mkdir -p .oldroot && pivot_root . .oldroot && cd /
    umount -l /.oldroot
    exec /usr/bin/env -i HOME=/root TERM=dumb PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        bash -c "$2"
' fresh-machine "$ROOT" "$RUN"
