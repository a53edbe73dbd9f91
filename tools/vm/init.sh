#!/bin/busybox sh
# /init of the Soft-RoCE test VM (runs as PID 1 from the initramfs).
#
# Shares from the host: "hostroot" is the host's / (read-only) and becomes the
# guest's root under a tmpfs overlay, so host-built binaries run unchanged at
# the same paths; "io" is the per-run folder (read-write) that carries vm.env and
# cmd.sh in and the exit status out. Nothing here is specific to one test.
/bin/busybox --install -s /bin
export PATH=/bin

say() { echo "rdmavm-guest: $*" > /dev/console; }
die() { say "SETUP FAILED: $*"; poweroff -f; sleep 10; }
# Progress goes into the kernel's log, which the runner keeps aside and shows
# when a boot gets stuck: the last step logged says where it stopped.
step() { echo "rdmavm-init: $*" > /dev/kmsg; }

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
step "proc, sys and dev mounted"

while read -r name args; do
  insmod "/modules/$name" $args 2>/dev/null || die "insmod $name"
done < /modules/order
step "modules loaded"

mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 io /io || die "mount io share"
step "io share mounted"
. /io/vm.env
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,ro,cache=loose hostroot /lower \
  || die "mount host root"
mount -t tmpfs -o mode=755 tmpfs /rw || die "tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot \
  || die "overlay"
for d in proc sys dev; do mount --bind "/$d" "/newroot/$d" || die "bind /$d"; done
mount -t tmpfs tmpfs /newroot/tmp
mkdir -p "/newroot$IO_HOST_PATH"
mount --bind /io "/newroot$IO_HOST_PATH" || die "bind io"
step "host root mounted under the overlay"

# Runs in the host's root, for the host's iproute2 `rdma` (busybox has none).
# Busybox's chroot runs its own applets first, so `ip` is busybox's.
host() { chroot /newroot "$@"; }
host ip link set lo up
if [ "$NETDEV" = dummy ]; then
  host ip link add sr0 type dummy || die "ip link add dummy"
  dev=sr0
else
  dev=eth0
fi
host ip link set "$dev" mtu "$MTU" || die "mtu $MTU on $dev"
host ip addr add "$SELF_IP/24" dev "$dev" || die "ip addr on $dev"
# No duplicate address detection: the address is usable at once, not after a
# second of it (busybox's ip knows no "nodad").
echo 0 > "/proc/sys/net/ipv6/conf/$dev/accept_dad"
host ip -6 addr add "$SELF_IP6/64" dev "$dev" || die "ip -6 addr on $dev"
host ip link set "$dev" up || die "link up $dev"
step "$dev up"
host rdma link add rxe0 type rxe netdev "$dev" || die "rdma link add rxe0 on $dev"
say "rxe0 on $dev ($SELF_IP, $SELF_IP6, mtu $MTU) ready"
step "running the command"

chroot /newroot /bin/bash "$IO_HOST_PATH/cmd.sh" > /dev/console 2>&1
echo $? > /io/status
step "the command ended"
sync
umount "/newroot$IO_HOST_PATH" 2>/dev/null
umount /io 2>/dev/null
poweroff -f
