#!/bin/busybox sh
# Corral guest init: the whole userspace a microVM/VM needs before the agent.
# Kernel command line (set by corral/backends/vm/qemu.py):
#   corral.layers=N     read-only EROFS layers on virtio-blk disks with serials l0..l(N-1), bottom first
#   corral.root=disk    (vm) the root is the ext4 disk with serial "root"; else an overlay of the layers
#                       over the ext4 scratch disk with serial "scratch"
#   corral.init=1       (vm) hand PID 1 to the image's own /sbin/init; the agent keeps running beside it
#   corral.probe=1      print a marker and power off (accelerator probe)
#   corral.hostname=H
#   corral.net=A/P,G    configure eth0 (virtio-net on the host's tap) with address A/P and default gateway G
/bin/busybox mkdir -p /bin /proc /sys /dev /layers /scratch /sysroot
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
fail() {
    echo "corral-init: error: $*" >/dev/ttyS0
    echo "corral-init: error: $*"
    poweroff -f
}
arg() {
    for word in $(cat /proc/cmdline); do
        case "$word" in "$1"=*) echo "${word#*=}"; return ;; esac
    done
}
if [ "$(arg corral.probe)" = 1 ]; then
    echo "CORRAL-PROBE-OK" >/dev/ttyS0
    poweroff -f
fi
for module in $(cat /modules.order); do
    insmod "/lib/modules/$module" 2>/dev/null
done
# virtio-mmio disks appear in no fixed order: name them by their serial.
tries=0
want="$(arg corral.layers)"
while :; do
    found=0
    for dev in /sys/block/vd*; do
        [ -e "$dev/serial" ] || continue
        serial="$(cat "$dev/serial")"
        [ -e "/dev/corral-$serial" ] || ln -s "/dev/${dev##*/}" "/dev/corral-$serial"
        found=$((found + 1))
    done
    [ "$found" -gt "${want:-0}" ] && break
    tries=$((tries + 1))
    [ "$tries" -gt 200 ] && fail "expected $want layer disks and a writable disk, found $found"
    usleep 10000
done
if [ "$(arg corral.root)" = disk ]; then
    mount -t ext4 /dev/corral-root /sysroot || fail "cannot mount the root disk"
else
    lowers=""
    i=0
    while [ "$i" -lt "$want" ]; do
        mkdir -p "/layers/$i"
        mount -t erofs -o ro "/dev/corral-l$i" "/layers/$i" || fail "cannot mount layer l$i"
        lowers="/layers/$i${lowers:+:$lowers}"
        i=$((i + 1))
    done
    mount -t ext4 /dev/corral-scratch /scratch || fail "cannot mount the scratch disk"
    mkdir -p /scratch/upper /scratch/work
    mount -t overlay overlay -o "lowerdir=$lowers,upperdir=/scratch/upper,workdir=/scratch/work" /sysroot \
        || fail "cannot mount the overlay"
fi
mkdir -p /sysroot/proc /sysroot/sys /sysroot/dev /sysroot/tmp
mount -t proc proc /sysroot/proc
mount -t sysfs sys /sysroot/sys
mount -t devtmpfs dev /sysroot/dev
mkdir -p /sysroot/dev/pts /sysroot/dev/shm
mount -t devpts devpts /sysroot/dev/pts
mount -t tmpfs shm /sysroot/dev/shm
hostname "$(arg corral.hostname)"
ip link set lo up 2>/dev/null
net="$(arg corral.net)"  # address/prefix,gateway of the guest's side of its tap link
if [ -n "$net" ]; then
    ip link set eth0 up && ip addr add "${net%,*}" dev eth0 && ip route add default via "${net#*,}" \
        || fail "cannot configure eth0 for $net"
fi
port=""
for p in /sys/class/virtio-ports/*; do
    [ "$(cat "$p/name" 2>/dev/null)" = corral.agent ] && port="/dev/${p##*/}"
done
[ -n "$port" ] || fail "no virtio-serial port named corral.agent"
echo "corral-init: starting the agent on $port"
# /sbin/init is often an absolute symlink (to systemd): look it up inside the new root.
init_link="$(readlink /sysroot/sbin/init)"
case "$init_link" in
    /*) init_file="/sysroot$init_link" ;;
    "") init_file=/sysroot/sbin/init ;;
    *) init_file="/sysroot/sbin/$init_link" ;;
esac
if [ "$(arg corral.init)" = 1 ] && [ -x "$init_file" ]; then
    # The image's init system takes PID 1; the agent becomes one of its services, started early and
    # restarted if it dies. Its binaries live in /run (a tmpfs handed over to the new root), never on disk.
    mkdir -p /sysroot/run
    mount -t tmpfs -o mode=755,nosuid,nodev run /sysroot/run
    mkdir -p /sysroot/run/corral /sysroot/run/systemd/system/sysinit.target.wants
    cp /agent /bin/busybox /sysroot/run/corral/
    cat >/sysroot/run/systemd/system/corral-agent.service <<UNIT
[Unit]
Description=Corral guest agent
DefaultDependencies=no

[Service]
ExecStart=/run/corral/agent --dev $port --tool /run/corral/busybox
Restart=always
RestartSec=100ms
KillMode=process
UNIT
    ln -s ../corral-agent.service /sysroot/run/systemd/system/sysinit.target.wants/corral-agent.service
    exec switch_root /sysroot /sbin/init
fi
exec /agent --dev "$port" --root /sysroot --tool /bin/busybox
