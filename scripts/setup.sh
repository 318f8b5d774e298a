#!/usr/bin/env bash
# Idempotent node setup for Corral: system packages, the repo's virtualenv, gVisor, the base images and the
# VM guest kit. Each step probes first, so a second run installs nothing and takes seconds.
#
#   scripts/setup.sh            install and build what is missing
#   scripts/setup.sh --check    say what would be installed or built, and change nothing
#
#   CORRAL_NODE_DIR    node-wide Corral files; layers go to $CORRAL_NODE_DIR/layers (default /var/lib/corral)
#   CORRAL_PYTHON      interpreter for the venv (default python3.11, else python3)
#   CORRAL_SETUP_LOG   where apt and pip write their output (default /var/tmp/corral-setup.log)
#   CORRAL_SETUP_TOOLCHAINS  1 (default): build debian-12-toolchains, the SandboxFusion API's C, C++, Java, Go and
#                      Node.js (about 1.4 GB, 5-6 minutes); 0: leave it to the server's first call that needs it
#
# Every probe of a tool that may be missing is written so that a missing tool means "install it": under
# `set -euo pipefail`, `x="$(missing-tool | sed ...)"` would end the script with status 127 before the
# branch that installs the tool (tests/integration/test_setup_script.py runs this with the tools hidden).
# A step that cannot succeed prints one line, `setup: error: <step>: <what to do>`, and exits 1.
set -euo pipefail

CHECK=0
case "${1:-}" in
    "") ;;
    --check) CHECK=1 ;;
    -h | --help) sed -n '2,12s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) printf 'setup: error: arguments: unknown argument %s; usage: scripts/setup.sh [--check]\n' "$1" >&2; exit 2 ;;
esac

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv"
STAMP="$VENV/.corral-installed"
NODE_DIR="${CORRAL_NODE_DIR:-/var/lib/corral}"
LAYER_DIR="$NODE_DIR/layers"
SETUP_LOG="${CORRAL_SETUP_LOG:-/var/tmp/corral-setup.log}"
# package:command — a package counts as installed when dpkg says so and its command (if named) is on PATH.
APT_PACKAGES=(erofs-utils:mkfs.erofs crun:crun runc:runc busybox-static:busybox debootstrap:debootstrap
              iproute2:ip nftables:nft gcc:gcc libc6-dev make:make postgresql qemu-system-x86:qemu-system-x86_64
              qemu-utils:qemu-img cpio:cpio kmod:modprobe e2fsprogs:mkfs.ext4
              btrfs-progs:mkfs.btrfs  # one btrfs per node holds the writable layers, a quota each
              fuse3:fusermount3 libfuse3-dev pkg-config:pkg-config  # FUSE: corral-lazyfs, layers on demand
              procps:sysctl git:git  # sysctl in sandbox network namespaces; git workspaces
              docker-registry:docker-registry skopeo:skopeo apache2-utils:htpasswd  # registry tests
              chromium:chromium chromium-driver:chromedriver)  # the web dashboard's browser tests
RUNSC_MIN_DATE=20230101  # bookworm's runsc (2022) has only the slow ptrace platform; backports' has systrap
# Older E2B SDKs, each installed apart from the venv's (two versions of a package cannot share it), into
# $VENV/e2b-<version>, as "<version>=<pip requirements>": 2.30, from before the /v2 endpoints
# (tests/e2b/test_e2b_old_sdk.py), and the 2.45 line with its code interpreter (tests/e2b/test_e2b_2_45.py).
E2B_OLD_SDKS=("2.30.0=e2b==2.30.0" "2.45.1=e2b==2.45.1 e2b-code-interpreter==2.10.0")
FIRST_BUILD_GIB=7        # free space the base images (3 GB with the toolchain image's build) and the guest kit need

PLANNED=0
log() { printf 'setup: %s\n' "$*"; }
# fail STEP WHAT-TO-DO: the one line a user reads when a step cannot succeed.
fail() { printf 'setup: error: %s: %s\n' "$1" "$2" >&2; exit 1; }
# plan WHAT: in --check mode, say what would be done; otherwise say it is being done.
plan() {
    PLANNED=$((PLANNED + 1))
    if ((CHECK)); then log "would $*"; else log "$*"; fi
}
have() { command -v "$1" >/dev/null 2>&1; }
# The log's most telling line: apt's first E:, pip's first ERROR: (even indented, from its build step).
first_error() {
    { grep -m1 -E '^\s*(E|ERROR):' "$SETUP_LOG" || grep -m1 -E '^\s*error:' "$SETUP_LOG" || true; } 2>/dev/null \
        | sed 's/^\s*//'
}

# -- 0. What no step can fix by itself ------------------------------------------------------------------
[[ $EUID -eq 0 ]] || fail "root" "run as root (setup installs packages, debootstraps images and mounts EROFS)"
have apt-get && have dpkg-query \
    || fail "system packages" "apt-get/dpkg-query not found: Corral's setup supports Debian 12 (bookworm)"
((CHECK)) || { : >"$SETUP_LOG"; } 2>/dev/null || SETUP_LOG=/dev/null

# apt_install WHAT ARGS...: one update, then the install; a failure names the mirror or the package.
APT_UPDATED=0
apt_install() {
    local what="$1"
    shift
    export DEBIAN_FRONTEND=noninteractive
    if ((!APT_UPDATED)); then
        # Error-Mode=any: an unreachable mirror is an error, not a warning followed by stale lists.
        apt-get update -qq -o APT::Update::Error-Mode=any >>"$SETUP_LOG" 2>&1 \
            || fail "apt-get update" "cannot reach the package mirror ($(first_error)); check the network, a proxy or /etc/apt/sources.list*, then run again"
        APT_UPDATED=1
    fi
    apt-get install -y -qq --no-install-recommends "$@" >>"$SETUP_LOG" 2>&1 \
        || fail "$what" "apt-get install failed ($(first_error)); full output in $SETUP_LOG"
}

# -- 1. Python 3.11 and the system packages -------------------------------------------------------------
find_python() { PYTHON="${CORRAL_PYTHON:-$(command -v python3.11 || command -v python3 || true)}"; }
python_ok() { [[ -n "$PYTHON" ]] && "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
find_python
if ! python_ok; then
    [[ -z "${CORRAL_PYTHON:-}" ]] || fail "python" "CORRAL_PYTHON=$CORRAL_PYTHON is not a Python 3.11 or newer"
    plan "install python3 and python3-venv (no Python 3.11 or newer found)"
    if ((CHECK)); then
        PYTHON=python3  # for the messages below; the venv and node steps wait for it
    else
        apt_install "python" python3 python3-venv
        find_python
        python_ok || fail "python" "Debian's python3 is older than 3.11; this is not Debian 12: install Python 3.11+ and set CORRAL_PYTHON"
    fi
fi
missing=()
for entry in "${APT_PACKAGES[@]}"; do
    pkg="${entry%%:*}"
    cmd="${entry#"$pkg"}"
    cmd="${cmd#:}"
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    if [[ "$status" != "install ok installed" ]] || { [[ -n "$cmd" ]] && ! have "$cmd"; }; then
        missing+=("$pkg")
    fi
done
# Debian's own python3 ships venv's ensurepip separately.
if [[ ! -x "$VENV/bin/python" ]] && ! "$PYTHON" -c 'import ensurepip' 2>/dev/null; then
    missing+=(python3-venv)
fi
if ((${#missing[@]})); then
    plan "install apt packages: ${missing[*]}"
    # --reinstall also restores a package whose files were removed by hand.
    ((CHECK)) || apt_install "apt packages" --reinstall "${missing[@]}"
fi

# -- 2. The kernel: EROFS and overlayfs (built in, or a module that loads) --------------------------------
for fs in erofs overlay; do
    grep -qw "$fs" /proc/filesystems 2>/dev/null && continue
    if ! have modprobe; then
        ((CHECK)) && { plan "load the $fs module (modprobe comes with kmod)"; continue; }
        fail "kernel" "no $fs filesystem and no modprobe to load it; install kmod or use a kernel with $fs"
    fi
    if ((CHECK)); then
        modprobe -n -q "$fs" 2>/dev/null \
            || fail "kernel" "this kernel has no $fs filesystem (modprobe -n $fs failed); Corral needs Linux 5.15+ with EROFS and overlayfs"
        plan "load the $fs module"
    else
        modprobe -q "$fs" 2>/dev/null && grep -qw "$fs" /proc/filesystems \
            || fail "kernel" "this kernel has no $fs filesystem (modprobe $fs failed); Corral needs Linux 5.15+ with EROFS and overlayfs"
    fi
done

# -- 3. The virtualenv; reinstalled only when pyproject.toml changed ------------------------------------
venv_ready=1
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c pass 2>/dev/null; then
    venv_ready=0
    plan "create the virtualenv $VENV ($("$PYTHON" --version 2>&1))"
    if ((!CHECK)); then
        rm -f "$STAMP"
        "$PYTHON" -m venv --clear "$VENV" >>"$SETUP_LOG" 2>&1 \
            || fail "virtualenv" "$PYTHON -m venv failed; full output in $SETUP_LOG"
    fi
fi
want="$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -d' ' -f1)"
have_stamp="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "$want" != "$have_stamp" ]]; then
    venv_ready=0
    plan "install corral[server,dev] into $VENV from PyPI (about a minute)"
    if ((!CHECK)); then
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$REPO_ROOT[server,dev]" \
            >>"$SETUP_LOG" 2>&1 \
            || fail "virtualenv" "pip install failed ($(first_error)); is PyPI reachable? full output in $SETUP_LOG"
        printf '%s\n' "$want" >"$STAMP"
        venv_ready=1
    fi
fi

# -- 4. gVisor (runtime="runsc") from bookworm-backports, on the host's own Debian mirror ----------------
runsc_date() {
    local version
    version="$(runsc --version 2>/dev/null)" || return 0  # not installed, or not runnable: no date
    sed -n 's/^runsc version [^~]*~\([0-9]\{8\}\).*/\1/p' <<<"$version" | head -1
}
date="$(runsc_date)"
if [[ "${date:-0}" -lt "$RUNSC_MIN_DATE" ]]; then
    plan "install runsc from bookworm-backports (have: ${date:-none})"
    if ((!CHECK)); then
        BACKPORTS=/etc/apt/sources.list.d/corral-bookworm-backports.sources
        if [[ ! -f "$BACKPORTS" ]]; then
            mirror="$("$VENV/bin/python" -c 'from corral.images.bases import debian_mirror; print(debian_mirror())' \
                      2>/dev/null || echo http://deb.debian.org/debian)"
            printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
                "$mirror" /usr/share/keyrings/debian-archive-keyring.gpg >"$BACKPORTS"
            APT_UPDATED=0  # the new source needs its lists
        fi
        apt_install "runsc" -t bookworm-backports runsc
        date="$(runsc_date)"
        [[ "${date:-0}" -ge "$RUNSC_MIN_DATE" ]] \
            || fail "runsc" "runsc from bookworm-backports is not runnable after install (runsc --version: $(runsc --version 2>&1 | head -1))"
    fi
fi

# -- 5. The older E2B SDKs, kept apart from the venv's e2b -----------------------------------------------
# Each directory's .installed holds the requirements it was installed with: new ones reinstall it.
for sdk in "${E2B_OLD_SDKS[@]}"; do
    sdk_dir="$VENV/e2b-${sdk%%=*}"
    read -r -a sdk_requirements <<<"${sdk#*=}"
    if [[ "$(cat "$sdk_dir/.installed" 2>/dev/null)" != "${sdk_requirements[*]}" ]]; then
        plan "install ${sdk_requirements[*]} into $sdk_dir"
        if ((!CHECK)); then
            rm -rf "$sdk_dir"
            "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts \
                --target "$sdk_dir" "${sdk_requirements[@]}" >>"$SETUP_LOG" 2>&1 \
                || fail "old e2b SDK" "pip install ${sdk_requirements[*]} failed ($(first_error)); full output in $SETUP_LOG"
            printf '%s\n' "${sdk_requirements[*]}" >"$sdk_dir/.installed"
        fi
    fi
done

# -- 6. Base images, the E2B template and the VM guest kit (each module probes its own state) -----------
# node_step STEP ARGS...: run a corral module; in --check mode it exits 10 when it has work to do.
node_step() {
    local step="$1" rc=0 said
    shift
    if ((CHECK)); then
        said="$(CORRAL_NODE_DIR="$NODE_DIR" "$VENV/bin/python" "$@" --check)" || rc=$?
        [[ -z "$said" ]] || printf '%s\n' "$said"
        case $rc in
            0) ;;
            10) PLANNED=$((PLANNED + $(grep -c '^setup: would ' <<<"$said" || true))) ;;
            *) fail "$step" "its check failed (status $rc, see above)" ;;
        esac
    else
        CORRAL_NODE_DIR="$NODE_DIR" "$VENV/bin/python" "$@" \
            || fail "$step" "failed (see the lines above); fix what they say and run scripts/setup.sh again"
    fi
}
if ((CHECK && !venv_ready)); then
    plan "build the base images and the VM guest kit that $NODE_DIR lacks (checked once the virtualenv is installed)"
else
    if ((!CHECK)); then
        mkdir -p "$NODE_DIR"
        free_gib=$(($(df -Pk "$NODE_DIR" | awk 'NR==2 {print $4}') >> 20))
        if ((free_gib < FIRST_BUILD_GIB)) && [[ ! -d "$LAYER_DIR/images" ]]; then
            fail "base images" "only $free_gib GiB free on the filesystem of $NODE_DIR, the first build needs $FIRST_BUILD_GIB GiB; free some space or set CORRAL_NODE_DIR"
        fi
    fi
    node_step "base images" -m corral.images.bases --store "$LAYER_DIR" busybox debian-12 debian-12-systemd
    if [[ "${CORRAL_SETUP_TOOLCHAINS:-1}" == 1 ]]; then  # the SandboxFusion API's compilers (corral/images/bases.py)
        node_step "toolchain image" -m corral.images.bases --store "$LAYER_DIR" debian-12-toolchains
    fi
    # E2B's "base" template (corral/gateway/e2b/template.py): debian-12 + sudo.
    node_step "e2b-base template" -m corral.gateway.e2b.template --store "$LAYER_DIR"
    # Debian's kernel (apt-get download), our initramfs, the KVM/TCG probe, the full-VM root disk.
    node_step "VM guest kit" -m corral.backends.vm.setup
fi

if ((CHECK)); then
    if ((PLANNED)); then log "$PLANNED step(s) would run; scripts/setup.sh does them"; else log "nothing to install"; fi
else
    log "ready ($VENV, $LAYER_DIR)"
fi
