#!/usr/bin/env bash
# Idempotent node setup for Corral: system packages, the repo's virtualenv and
# the base images. Each step checks first, so a second run takes seconds.
#
#   CORRAL_NODE_DIR    node-wide Corral files; layers go to $CORRAL_NODE_DIR/layers (default /var/lib/corral)
#   CORRAL_PYTHON      interpreter for the venv (default python3.11, else python3)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv"
STAMP="$VENV/.corral-installed"
LAYER_DIR="${CORRAL_NODE_DIR:-/var/lib/corral}/layers"
APT_PACKAGES=(erofs-utils crun runc busybox-static debootstrap iproute2 nftables gcc libc6-dev make postgresql
              qemu-system-x86 qemu-utils cpio kmod e2fsprogs)

log() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

[[ $EUID -eq 0 ]] || die "run as root (installs packages, debootstraps and mounts images)"

PYTHON="${CORRAL_PYTHON:-$(command -v python3.11 || command -v python3 || true)}"
[[ -n "$PYTHON" ]] || die "no python3.11 found; install python3 (3.11 or newer)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PYTHON is older than 3.11"

# 1. System packages: apt-get update only when something is missing.
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
# Debian's own python3 ships venv's ensurepip separately.
if [[ ! -x "$VENV/bin/python" ]] && ! "$PYTHON" -c 'import ensurepip' 2>/dev/null; then
    missing+=(python3-venv)
fi
if ((${#missing[@]})); then
    log "installing apt packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
log "apt packages ok"


for fs in erofs overlay; do
    grep -qw "$fs" /proc/filesystems || modprobe "$fs" 2>/dev/null \
        || log "warning: kernel has no $fs filesystem (modprobe $fs failed)"
done

# 2. The virtualenv; reinstall only when pyproject.toml changed.
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c pass 2>/dev/null; then
    log "creating virtualenv $VENV ($("$PYTHON" --version))"
    rm -f "$STAMP"
    "$PYTHON" -m venv --clear "$VENV"
fi
want="$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "$want" != "$have" ]]; then
    log "installing corral[server,dev] into $VENV (about a minute)"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$REPO_ROOT[server,dev]"
    printf '%s\n' "$want" >"$STAMP"
fi
log "virtualenv ok ($VENV)"

# gVisor (runtime="runsc"): bookworm's own runsc (2022) only has the slow ptrace platform; the
# bookworm-backports one has systrap and checkpoint/restore. Its source goes on the host's Debian mirror.
runsc_date="$(runsc --version 2>/dev/null | sed -n 's/^runsc version [^~]*~\([0-9]\{8\}\).*/\1/p')"
if [[ "${runsc_date:-0}" -lt 20230101 ]]; then
    BACKPORTS=/etc/apt/sources.list.d/corral-bookworm-backports.sources
    if [[ ! -f "$BACKPORTS" ]]; then
        mirror="$("$VENV/bin/python" -c 'from corral.images.bases import debian_mirror; print(debian_mirror())' \
                  2>/dev/null || echo http://deb.debian.org/debian)"
        printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
            "$mirror" /usr/share/keyrings/debian-archive-keyring.gpg >"$BACKPORTS"
    fi
    log "installing runsc from bookworm-backports"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends -t bookworm-backports runsc >/dev/null
fi
log "runsc ok ($(runsc --version 2>/dev/null | head -1))"

# An E2B SDK from before the /v2 endpoints, for tests/e2b/test_e2b_old_sdk.py (kept apart from the venv's e2b).
E2B_OLD_VERSION=2.30.0
E2B_OLD_DIR="$VENV/e2b-$E2B_OLD_VERSION"
if [[ ! -f "$E2B_OLD_DIR/.installed" ]]; then
    log "installing e2b==$E2B_OLD_VERSION into $E2B_OLD_DIR"
    rm -rf "$E2B_OLD_DIR"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts \
        --target "$E2B_OLD_DIR" "e2b==$E2B_OLD_VERSION"
    touch "$E2B_OLD_DIR/.installed"
fi

# 3. Base images: built once per node into the shared layer store.
"$VENV/bin/python" -m corral.images.bases --store "$LAYER_DIR" busybox debian-12 debian-12-systemd
# E2B's "base" template (corral/gateway/e2b/template.py): debian-12 + sudo, built once.
"$VENV/bin/python" -m corral.gateway.e2b.template --store "$LAYER_DIR"
log "base images ok ($LAYER_DIR)"

# 4. VM guests: the guest kernel (Debian's, via apt-get download), our initramfs, the KVM/TCG probe.
CORRAL_NODE_DIR="${CORRAL_NODE_DIR:-/var/lib/corral}" "$VENV/bin/python" -m corral.backends.vm.setup
log "done"
