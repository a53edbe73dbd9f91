#!/usr/bin/env bash
# Runs a command where it can use real RDMA verbs, and returns its exit status.
#
#   tools/vm/run.sh [--vms 1|2] [--timeout SECONDS] [--] COMMAND [ARGS...]
#
# Where the machine has an active RDMA port with an IPv4 address (and
# RDMARPC_VM is not "always"), COMMAND runs right here. Otherwise a throw-away
# QEMU (TCG) VM boots a stock Debian kernel with Soft-RoCE (rdma_rxe) and
# rdma_cm, sees the host's / read-only under a tmpfs overlay, and runs COMMAND
# there in the same working directory with the same environment.
# Bazel uses it as a test wrapper: --run_under=//tools/vm:run.
#
# The command learns where it is from the environment:
#   RDMARPC_TEST_ADDR  IPv4 of the local RDMA-capable interface (bind/connect here)
#   RDMARPC_TEST_ADDR6 a global IPv6 address of that interface, where it has one
#   RDMARPC_PEER_ADDR  the other VM's address (two-VM mode only)
#   RDMARPC_PEER_ADDR6 the other VM's IPv6 address (two-VM mode only)
#   RDMARPC_VM_ROLE    "single", or "server" / "client" in two-VM mode, "host"
#   RDMARPC_VM_OUT     a directory the command may write files to: where the
#                      caller sets RDMARPC_VM_KEEP to a directory of this
#                      machine, they are copied there at the end (the guest's
#                      own writes go to a throw-away overlay and /tmp is its own)
# In two-VM mode the same command runs in both VMs, joined by a virtual wire.
#
# Exit status: the command's (in two-VM mode the first non-zero of the two), or
# 97 when the VM gave no status (did not boot, setup failed, or timed out).
set -uo pipefail

here=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
vms=1
timeout_s=${RDMARPC_VM_TIMEOUT:-900}
while [ $# -gt 0 ]; do
  case "$1" in
    --vms) vms=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }

infra_fail() { echo "rdmavm: INFRA: $*" >&2; exit 97; }

# The netdev of an active RDMA port with an IPv4 address, if the host has one.
host_rdma_netdev() {
  command -v rdma >/dev/null || return 1
  local netdev
  for netdev in $(rdma link show 2>/dev/null | awk '/state ACTIVE/ {for (i=1;i<NF;i++) if ($i=="netdev") print $(i+1)}'); do
    if ip -4 -o addr show dev "$netdev" 2>/dev/null | grep -q .; then echo "$netdev"; return 0; fi
  done
  return 1
}
first_addr() {  # $1 = -4 or -6, $2 = netdev
  ip "$1" -o addr show dev "$2" scope global 2>/dev/null | awk '{split($4,a,"/"); print a[1]; exit}'
}

if [ "${RDMARPC_VM:-auto}" != always ] && [ "$vms" = 1 ]; then
  netdev=$(host_rdma_netdev || true)
  addr=${RDMARPC_TEST_ADDR:-$([ -z "$netdev" ] || first_addr -4 "$netdev")}
  if [ -n "$addr" ]; then
    addr6=${RDMARPC_TEST_ADDR6:-$([ -z "$netdev" ] || first_addr -6 "$netdev")}
    echo "rdmavm: using this machine's RDMA device directly (address $addr${addr6:+, $addr6})" >&2
    # The out directory is the caller's, or one that goes when the command ends.
    out=${RDMARPC_VM_KEEP:-$(mktemp -d "${TMPDIR:-/tmp}/rdmavm-out.XXXXXX")}
    mkdir -p "$out"
    RDMARPC_TEST_ADDR=$addr RDMARPC_TEST_ADDR6=$addr6 RDMARPC_VM_ROLE=host RDMARPC_VM_OUT=$out "$@"
    rc=$?
    [ -n "${RDMARPC_VM_KEEP:-}" ] || rm -rf "$out"
    exit "$rc"
  fi
fi
[ "${RDMARPC_VM:-auto}" != never ] || infra_fail "RDMARPC_VM=never but no active RDMA port with an IPv4 address here"

vm_dir=${RDMARPC_VM_DIR:-$here/../../.cache/vm}
[ -f "$vm_dir/vmlinuz" ] && [ -f "$vm_dir/initrd.cpio.gz" ] \
  || infra_fail "no VM image in $vm_dir: run tools/vm/prepare.sh (make deps does)"
command -v qemu-system-x86_64 >/dev/null || infra_fail "qemu-system-x86_64 missing: make deps"

run=$(mktemp -d "${TMPDIR:-/tmp}/rdmavm.XXXXXX")
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$run"' EXIT

# cmd.sh: the caller's environment, working directory and command, for bash.
write_cmd() {  # $1 = io dir, $2 = role, $3/$4 = self ip/ipv6, $5/$6 = peer ip/ipv6, rest = command
  local io=$1 role=$2 self=$3 self6=$4 peer=$5 peer6=$6; shift 6
  mkdir -p "$io/out"
  {
    local var
    while IFS= read -r var; do
      case "$var" in PWD|OLDPWD|SHLVL|_|BASH_*|XML_OUTPUT_FILE) continue ;; esac
      printf 'export %s=%q\n' "$var" "${!var}"
    done < <(compgen -e)
    printf 'export RDMARPC_VM_ROLE=%q RDMARPC_TEST_ADDR=%q RDMARPC_TEST_ADDR6=%q' "$role" "$self" "$self6"
    printf ' RDMARPC_PEER_ADDR=%q RDMARPC_PEER_ADDR6=%q RDMARPC_VM_OUT=%q\n' "$peer" "$peer6" "$io/out"
    [ -z "${XML_OUTPUT_FILE:-}" ] || printf 'export XML_OUTPUT_FILE=%q\n' "$io/test.xml"
    printf 'cd %q || exit 96\n' "$PWD"
    printf 'exec'; printf ' %q' "$@"; printf '\n'
  } > "$io/cmd.sh"
}

# clocksource=tsc: under TCG the guest kernel otherwise picks the HPET, which
# the vDSO cannot read, so every clock_gettime became a system call plus an
# emulated MMIO read (9 % of a busy-polling benchmark's time). A real host
# reads the TSC in user space; so does the guest with this.
# init_on_alloc=0: Debian's kernel zeroes every kmalloc by default, and
# Soft-RoCE allocates one buffer per packet, so that memset was 8-9 % of all
# CPU samples of a 1 MiB READ stream (ib_read_bw and ours alike); without it
# both run ~25 % faster at the same ratio (README, Benchmarks, has what it
# did to latency). A NIC does this work in hardware; the guest is a
# throwaway test machine.
boot() {  # $1 = io dir, $2 = prefix for output lines, rest = extra qemu args
  local io=$1 prefix=$2; shift 2
  timeout --kill-after=10 "$timeout_s" qemu-system-x86_64 \
    -nodefaults -no-user-config -display none -no-reboot \
    -accel tcg,thread=multi -cpu max -m "${RDMARPC_VM_MEM:-2G}" -smp 2 \
    -kernel "$vm_dir/vmlinuz" -initrd "$vm_dir/initrd.cpio.gz" \
    -append "console=ttyS0 panic=-1 quiet loglevel=0 rdinit=/init clocksource=tsc tsc=reliable init_on_alloc=0" \
    -serial stdio \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs "local,path=$io,mount_tag=io,security_model=none" \
    "$@" < /dev/null 2>&1 | tr -d '\r' | sed -u "s/^/$prefix/"
}

mtu=${RDMARPC_VM_MTU:-9000}
start=$(date +%s)
if [ "$vms" = 1 ]; then
  io=$run/vm0; mkdir -p "$io"
  printf 'NETDEV=dummy\nSELF_IP=10.77.0.1\nSELF_IP6=fd77::1\nMTU=%s\nIO_HOST_PATH=%s\n' "$mtu" "$io" > "$io/vm.env"
  write_cmd "$io" single 10.77.0.1 fd77::1 "" "" "$@"
  echo "rdmavm: booting Soft-RoCE VM (TCG) for: $*" >&2
  boot "$io" ""
  ios=("$io")
elif [ "$vms" = 2 ]; then
  ios=()
  for i in 0 1; do
    io=$run/vm$i; mkdir -p "$io"; ios+=("$io")
    role=$([ $i = 0 ] && echo server || echo client)
    printf 'NETDEV=virtio\nSELF_IP=10.77.0.%d\nSELF_IP6=fd77::%d\nMTU=%s\nIO_HOST_PATH=%s\n' \
      $((i + 1)) $((i + 1)) "$mtu" "$io" > "$io/vm.env"
    write_cmd "$io" "$role" "10.77.0.$((i + 1))" "fd77::$((i + 1))" "10.77.0.$((2 - i))" "fd77::$((2 - i))" "$@"
  done
  echo "rdmavm: booting two Soft-RoCE VMs (TCG) on a virtual wire for: $*" >&2
  wire() { echo "-netdev dgram,id=n0,local.type=unix,local.path=$run/sock$1,remote.type=unix,remote.path=$run/sock$2 -device virtio-net-pci,netdev=n0,mac=52:54:00:77:00:0$1"; }
  # shellcheck disable=SC2046
  boot "${ios[0]}" "[server] " $(wire 0 1) &
  # shellcheck disable=SC2046
  boot "${ios[1]}" "[client] " $(wire 1 0) &
  wait
else
  infra_fail "--vms must be 1 or 2"
fi

rc=0
for io in "${ios[@]}"; do
  if [ ! -f "$io/status" ]; then
    infra_fail "no status from guest $(basename "$io") after $(( $(date +%s) - start )) s (VM did not boot, setup failed, or timed out at ${timeout_s}s)"
  fi
  s=$(cat "$io/status")
  [ "$rc" != 0 ] || rc=$s
done
if [ -n "${XML_OUTPUT_FILE:-}" ] && [ -f "${ios[0]}/test.xml" ]; then
  cp "${ios[0]}/test.xml" "$XML_OUTPUT_FILE"
fi
if [ -n "${RDMARPC_VM_KEEP:-}" ]; then
  mkdir -p "$RDMARPC_VM_KEEP"
  for io in "${ios[@]}"; do cp -a "$io/out/." "$RDMARPC_VM_KEEP/"; done
fi
echo "rdmavm: guest exit status $rc after $(( $(date +%s) - start )) s" >&2
exit "$rc"
