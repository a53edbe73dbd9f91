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
#                      own writes go to a throw-away overlay and /tmp is its own);
#                      in two-VM mode each guest's go to a subdirectory named
#                      by its role, since the same command writes the same names
# In two-VM mode the same command runs in both VMs, joined by a virtual wire.
#
# A guest not booted within RDMARPC_VM_BOOT_TIMEOUT seconds (120) has its
# kernel's log and stacks printed and is booted again, once
# (for run_test.sh, RDMARPC_VM_FAKE_STUCK_BOOT=1 makes every boot stick, and
# =late makes each wait for the runner's diagnosis, as a slow boot would); one
# that took RDMARPC_VM_SLOW_BOOT seconds (30) or more is reported.
# A command still running close to the time limit (--timeout, or Bazel's
# TEST_TIMEOUT where smaller; RDMARPC_VM_WATCHDOG seconds of guest uptime
# where set) has the stacks of its processes printed and is killed.
# The guest kernel's messages are kept out of the command's output; when the
# command fails, those logged while it ran are printed after it, and when a
# guest gives no status at all, its log from /init on.
#
# Exit status: the command's (in two-VM mode the first non-zero of the two),
# 124 when the watchdog killed it, or 97 when the VM gave no status (did not
# boot, setup failed, or timed out).
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

# The guest's watchdog. A hung test would otherwise be killed from outside
# (Bazel's TEST_TIMEOUT, or --timeout here) with nothing said about where it
# hung. So, when the command still runs $1 seconds after the guest booted, the
# guest prints the stack of every thread of every process it started (shell
# scripts: their command line), kills them and ends with status 124. Both
# functions run in the guest: write_cmd copies them into cmd.sh.
guest_descendants() {  # $1 = pid: it and everything it started, parents first
  local all=" $1 " grew=1 p stat
  while [ "$grew" = 1 ]; do
    grew=0
    for p in /proc/[0-9]*; do
      p=${p#/proc/}
      case "$all" in *" $p "*) continue ;; esac
      read -r stat < "/proc/$p/stat" 2>/dev/null || continue
      # The parent is the second field after the ")" that ends the name.
      set -- ${stat##*) }
      case "$all" in *" $2 "*) all="$all$p "; grew=1 ;; esac
    done
  done
  echo $all
}
guest_watchdog_run() {  # $1 = seconds of guest uptime it may run, rest = command
  local limit=$1; shift
  "$@" &
  local pid=$!
  (
    up=$(cut -d. -f1 /proc/uptime)
    sleep $(( limit > up ? limit - up : 0 ))
    kill -0 "$pid" 2>/dev/null || exit 0
    procs=$(guest_descendants "$pid")
    echo "rdmavm-guest: WATCHDOG: still running after ${limit} s of guest uptime, close to its time limit; the stacks of its processes ($procs) follow, then they are killed"
    for p in $procs; do
      exe=$(readlink "/proc/$p/exe" 2>/dev/null) || continue
      echo "rdmavm-guest: WATCHDOG: process $p: $(tr '\0' ' ' < "/proc/$p/cmdline")"
      case "${exe##*/}" in bash|sh|dash) continue ;; esac
      if command -v gdb >/dev/null; then
        timeout 90 gdb -p "$p" -batch -nx -iex 'set debuginfod enabled off' \
          -ex 'thread apply all bt' 2>&1 | grep -v '^\[New LWP'
      else
        echo "rdmavm-guest: WATCHDOG: no gdb (tools/deps.sh installs it); kernel stacks:"
        for t in /proc/$p/task/*; do echo "thread ${t##*/}:"; cat "$t/stack"; done
      fi
    done
    touch /tmp/rdmavm-watchdog-fired
    kill -KILL $procs 2>/dev/null
    echo "rdmavm-guest: WATCHDOG: killed $procs"
  ) &
  local guard=$!
  wait "$pid"
  local rc=$?
  if [ -e /tmp/rdmavm-watchdog-fired ]; then
    # The watchdog killed the command: let it say so. Killed as the command
    # ended, it lost that line under load.
    wait "$guard"
    rc=124
  else
    kill "$guard" 2>/dev/null
  fi
  return "$rc"
}

# The time the whole run may take: --timeout, or less where Bazel's
# TEST_TIMEOUT says so. The guest's watchdog fires a quarter of it (at least
# 60 s) before the end, which leaves gdb time: under TCG it reads a large
# binary's symbols slowly.
limit_s=$timeout_s
[ -z "${TEST_TIMEOUT:-}" ] || [ "$TEST_TIMEOUT" -ge "$limit_s" ] || limit_s=$TEST_TIMEOUT
margin_s=$(( limit_s / 4 > 60 ? limit_s / 4 : 60 ))
# A guest that has not reached its command this long after qemu started is
# stuck in boot (it takes ~6 s, ~20 s with two busy VMs): it is booted again,
# once. Seen here: 1 boot in ~160 printed nothing at all, and a CI run failed
# on it as a test timeout.
boot_s=${RDMARPC_VM_BOOT_TIMEOUT:-120}
slow_boot_s=${RDMARPC_VM_SLOW_BOOT:-30}

# cmd.sh: the caller's environment, working directory and command, for bash.
# It marks the guest as booted ("ready") and runs the command under the watchdog.
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
    [ "${RDMARPC_VM_FAKE_STUCK_BOOT:-}" != late ] || printf 'until [ -e %q ]; do sleep 0.2; done\n' "$io/unstick"
    printf ': > %q\n' "$io/ready"
    printf 'cd %q || exit 96\n' "$PWD"
    declare -f guest_descendants guest_watchdog_run
    printf 'guest_watchdog_run %q' "$watchdog_s"; printf ' %q' "$@"; printf '\n'
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
# The console goes through one unbuffered sed: when Bazel kills a test that
# ran out of time, a pipe buffer (tr's was 4 KiB) would lose what the guest
# printed last, which is what says where it stopped. The kernel logs
# everything (loglevel=7) and sed moves its lines (they open with a
# "[seconds]" stamp) into $io.kernel, so a stuck boot can show how far it got
# without every test's log carrying ~350 lines of boot. The kernel writes to
# the serial port between the bytes of a line the command is still sending,
# so a stamp (with its six decimals) can come mid-line: the line is cut
# there, the command's part printed, the kernel's moved.
# The monitor's pipe lets watch_boot press SysRq on the guest's keyboard.
boot() {  # $1 = io dir, $2 = prefix for output lines, rest = extra qemu args
  local io=$1 prefix=$2; shift 2
  mkfifo "$io.mon.in" "$io.mon.out"
  timeout --kill-after=10 "$timeout_s" qemu-system-x86_64 \
    -nodefaults -no-user-config -display none -no-reboot \
    -accel tcg,thread=multi -cpu max -m "${RDMARPC_VM_MEM:-2G}" -smp 2 \
    -kernel "$vm_dir/vmlinuz" -initrd "$vm_dir/initrd.cpio.gz" \
    -append "console=ttyS0 panic=-1 loglevel=7 sysrq_always_enabled rdinit=/init nokaslr clocksource=tsc tsc=reliable init_on_alloc=0" \
    -serial stdio \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs "local,path=$io,mount_tag=io,security_model=none" \
    -monitor "pipe:$io.mon" -pidfile "$io.pid" "$@" < /dev/null 2>&1 \
    | sed -u -e 's/\r//g' -e 's/^\(..*\)\(\[ *[0-9]\+\.[0-9]\{6\}\] \)/\1\n\2/' \
      -e "/\n/{h;s/\n.*//;s/^/$prefix/;p;g;s/^[^\n]*\n//}" \
      -e "/^\[ *[0-9]*\.[0-9]*\] /{w $io.kernel" -e 'd}' -e "s/^/$prefix/"
}

# Kernel lines on stderr, marked as the guest kernel's.
as_kernel_lines() { sed 's/^/rdmavm-kernel: /' >&2; }

# A guest's kernel log from its /init on (where it got that far), or its end;
# init's steps are in it ("rdmavm-init: ...").
show_kernel_log() {  # $1 = io dir, $2 = what happened to the guest
  local name
  name=$(basename "$1")
  if [ ! -s "$1.kernel" ]; then
    echo "rdmavm: INFRA: guest $name $2; its kernel printed nothing: stuck in qemu or the firmware" >&2
  elif grep -q 'Run /init as init process' "$1.kernel"; then
    echo "rdmavm: INFRA: guest $name $2; its kernel's log from /init on:" >&2
    sed -n '/Run \/init as init process/,$p' "$1.kernel" | tail -n 200 | as_kernel_lines
  else
    echo "rdmavm: INFRA: guest $name $2; its kernel's log did not reach /init, its end:" >&2
    tail -n 80 "$1.kernel" | as_kernel_lines
  fi
}

# What the guest's kernel logged while the command ran. rxe warns that its
# dummy netdev has no link speed at every port query: not news, left out.
show_command_kernel_log() {  # $1 = io dir
  local lines
  lines=$(sed -n '/rdmavm-init: running the command/,/rdmavm-init: the command ended/p' "$1.kernel" 2>/dev/null \
    | grep -v -e 'rdmavm-init: ' -e 'speed is unknown, defaulting to' | tail -n 100)
  [ -n "$lines" ] || return 0
  echo "rdmavm: guest $(basename "$1")'s kernel logged while the command ran:" >&2
  as_kernel_lines <<<"$lines"
}

# Where a stuck guest's vCPUs are, through qemu's monitor: a hang early in
# boot comes before the keyboard driver that SysRq needs. Registers are read
# twice, a second apart (HLT=1 is a vCPU idle, waiting for an interrupt; a
# RIP that differs between the two reads is one that runs); then each vCPU's
# stack is read, and the words on it that point into kernel text are named,
# innermost first (as with the kernel's "?" entries, some are stale). Names
# come from the symbols prepare.sh read (the guest boots with nokaslr, so
# they hold in every boot).
show_vcpus() {  # $1 = io dir
  local io=$1 look cpu rsp
  [ -s "$vm_dir/kallsyms" ] || echo "rdmavm: INFRA: no kernel symbols in $vm_dir/kallsyms, so the addresses below are bare: tools/vm/prepare.sh reads them (make deps), and says why it could not" >&2
  for look in 1 2; do
    echo "rdmavm: INFRA: guest $(basename "$io")'s vCPUs (look $look of 2):" >&2
    ask_monitor "$io" 'info registers -a' > "$io.regs"
    name_addresses regs < "$io.regs"
  done
  while read -r cpu rsp; do
    ask_monitor "$io" "cpu $cpu" "x/96gx 0x$rsp" | name_addresses "stack $cpu"
  done < <(awk '/^CPU#/ { c = substr($1, 5) } /RSP=/ { match($0, /RSP=[0-9a-f]+/); print c, substr($0, RSTART + 4, RLENGTH - 4) }' "$io.regs")
}

# Gives qemu's monitor the commands.
tell_monitor() {  # $1 = io dir, rest = monitor commands
  local io=$1; shift
  # Opened read-write, a FIFO never blocks, even where qemu is gone.
  printf '%s\n' "$@" 1<> "$io.mon.in"
}

# Gives qemu's monitor the commands and prints what it wrote since the last
# time, which the parser skips but for the answers (sendkey echoes and all).
ask_monitor() {  # $1 = io dir, rest = monitor commands
  tell_monitor "$@"
  sleep 1
  timeout 1 cat "$1.mon.out" 2>/dev/null | tr -d '\r'
}

# Reads the monitor's output; prints each vCPU's RIP ("regs") or the text
# addresses in a stack dump ("stack N"), named from $vm_dir/kallsyms.
name_addresses() {  # $1 = regs | "stack N"
  awk -v what="$1" -v syms="$vm_dir/kallsyms" '
    function name(a,   lo, hi, mid, off) {
      if (n == 0 || a < addr[1] || a > addr[n]) return a
      lo = 1; hi = n
      while (lo < hi) { mid = int((lo + hi + 1) / 2); if (addr[mid] <= a) lo = mid; else hi = mid - 1 }
      off = hex(a) - hex(addr[lo])
      # Far past its symbol: init text, freed by then and not listed.
      return off < 65536 ? sym[lo] "+0x" sprintf("%x", off) : a
    }
    function hex(h,   v, i) { v = 0; for (i = 9; i <= 16; i++) v = v * 16 + index("0123456789abcdef", substr(h, i, 1)) - 1; return v }
    BEGIN {
      # Kernel text addresses are 16 lower-case hex digits: as strings they
      # compare as numbers; offsets need only the low 32 bits.
      while ((getline line < syms) > 0) { split(line, f, " "); n++; addr[n] = f[1]; sym[n] = f[3] }
    }
    what == "regs" && /^CPU#/ { cpu = $1 }
    what == "regs" && /^RIP=/ { print "rdmavm-vcpu: " cpu " RIP=" name(substr($1, 5)) " " $NF }
    what != "regs" && /^[0-9a-f]+: 0x/ {
      for (i = 2; i <= NF; i++) if ($i ~ /^0xffffffff8/) { a = substr($i, 3); if (n == 0 || (a >= addr[1] && a <= addr[n])) t = t " " name(a) }
    }
    END { if (what != "regs") print "rdmavm-vcpu: CPU#" substr(what, 7) " stack:" (t == "" ? " (no kernel text addresses)" : t) }
  ' >&2
}

# Kills the VMs unless every guest reaches its command within boot_s, or
# while the stuck ones are looked into.
watch_boot() {
  local t io up
  for (( t = 0; t < boot_s; t++ )); do
    up=1
    for io in "${ios[@]}"; do [ -e "$io/ready" ] || up=0; done
    [ "$up" = 0 ] || return 0
    sleep 1
  done
  local stuck=() late=()
  for io in "${ios[@]}"; do
    [ -e "$io/ready" ] && continue
    late+=("$io")
    echo "rdmavm: INFRA: guest $(basename "$io") not booted after ${boot_s} s; asking its kernel for stacks (SysRq w, l)" >&2
    tell_monitor "$io" 'sendkey alt-sysrq-8' 'sendkey alt-sysrq-w' 'sendkey alt-sysrq-l'
    [ "${RDMARPC_VM_FAKE_STUCK_BOOT:-}" != late ] || : > "$io/unstick"
  done
  sleep 10
  # One that got there meanwhile was slow, not stuck: it runs on.
  for io in "${late[@]}"; do [ -e "$io/ready" ] || stuck+=("$io"); done
  [ "${#stuck[@]}" != 0 ] || return 0
  : > "$run/boot_hung"
  for io in "${stuck[@]}"; do
    show_kernel_log "$io" "is stuck in boot"
    show_vcpus "$io"
  done
  for io in "${ios[@]}"; do
    # qemu writes its pid file before the guest starts, but maybe after boot_s.
    t=0
    while [ ! -s "$io.pid" ] && [ "$t" -lt 50 ]; do sleep 0.2; t=$((t + 1)); done
    kill "$(cat "$io.pid" 2>/dev/null)" 2>/dev/null
  done
}
wire() { echo "-netdev dgram,id=n0,local.type=unix,local.path=$run/sock$1,remote.type=unix,remote.path=$run/sock$2 -device virtio-net-pci,netdev=n0,mac=52:54:00:77:00:0$1"; }

# vm.env: what init needs for its setup. init sources it before that setup, so
# a guest told to sleep there is stuck in boot as far as the runner can tell.
write_env() {  # $1 = io dir, $2 = netdev kind, $3/$4 = self ip/ipv6
  printf 'NETDEV=%s\nSELF_IP=%s\nSELF_IP6=%s\nMTU=%s\nIO_HOST_PATH=%s\n' "$2" "$3" "$4" "$mtu" "$1" > "$1/vm.env"
  [ "${RDMARPC_VM_FAKE_STUCK_BOOT:-}" != 1 ] || echo 'sleep 100000' >> "$1/vm.env"
}

role_of() { [ "$1" = 0 ] && echo server || echo client; }  # $1 = guest index, two-VM mode
# Writes each guest's files, boots the VMs and returns when they are all off.
boot_all() {  # the command
  local began elapsed i io role pids=()
  began=$(date +%s)
  elapsed=$(( began - start ))
  watchdog_s=${RDMARPC_VM_WATCHDOG:-$(( limit_s - margin_s - elapsed > 1 ? limit_s - margin_s - elapsed : 1 ))}
  rm -f "$run/boot_hung" "$run"/sock* "$run"/*.pid "$run"/*.mon.* "$run"/*.kernel
  for (( i = 0; i < vms; i++ )); do
    io=${ios[$i]}
    rm -rf "$io"; mkdir -p "$io"
    if [ "$vms" = 1 ]; then
      write_env "$io" dummy 10.77.0.1 fd77::1
      write_cmd "$io" single 10.77.0.1 fd77::1 "" "" "$@"
      boot "$io" "" &
    else
      role=$(role_of "$i")
      write_env "$io" virtio "10.77.0.$((i + 1))" "fd77::$((i + 1))"
      write_cmd "$io" "$role" "10.77.0.$((i + 1))" "fd77::$((i + 1))" "10.77.0.$((2 - i))" "fd77::$((2 - i))" "$@"
      # shellcheck disable=SC2046
      boot "$io" "[$role] " $(wire "$i" $((1 - i))) &
    fi
    pids+=($!)
  done
  watch_boot &
  local watcher=$!
  wait "${pids[@]}"
  kill "$watcher" 2>/dev/null
  wait "$watcher" 2>/dev/null
  [ -e "$run/boot_hung" ] || report_slow_boot "$began"
}

# How long boots take under load is what boot_s is set by, so a slow one is
# reported. Its time is when each guest's "ready" file was made, in the
# host's clock: the watcher may be gone before it could say so.
report_slow_boot() {  # $1 = when qemu started, in seconds since the epoch
  local io t slowest=0
  for io in "${ios[@]}"; do
    [ -e "$io/ready" ] || return 0
    t=$(( $(stat -c %Y "$io/ready") - $1 ))
    [ "$t" -le "$slowest" ] || slowest=$t
  done
  [ "$slowest" -lt "$slow_boot_s" ] \
    || echo "rdmavm: INFRA: slow boot: the guests reached their command after ~$slowest s (~6 s is usual, $boot_s s the limit)" >&2
}

mtu=${RDMARPC_VM_MTU:-9000}
start=$(date +%s)
case "$vms" in
  1) echo "rdmavm: booting Soft-RoCE VM (TCG) for: $*" >&2 ;;
  2) echo "rdmavm: booting two Soft-RoCE VMs (TCG) on a virtual wire for: $*" >&2 ;;
  *) infra_fail "--vms must be 1 or 2" ;;
esac
ios=()
for (( i = 0; i < vms; i++ )); do ios+=("$run/vm$i"); done
boot_all "$@"
if [ -e "$run/boot_hung" ]; then
  echo "rdmavm: INFRA: booting again, once" >&2
  boot_all "$@"
  [ ! -e "$run/boot_hung" ] || infra_fail "the VM did not boot twice in a row (consoles above)"
fi

rc=0
for io in "${ios[@]}"; do
  if [ ! -f "$io/status" ]; then
    show_kernel_log "$io" "gave no status"
    infra_fail "no status from guest $(basename "$io") after $(( $(date +%s) - start )) s (VM did not boot, setup failed, or timed out at ${timeout_s}s)"
  fi
  s=$(cat "$io/status")
  [ "$s" = 0 ] || show_command_kernel_log "$io"
  [ "$rc" != 0 ] || rc=$s
done
if [ -n "${XML_OUTPUT_FILE:-}" ] && [ -f "${ios[0]}/test.xml" ]; then
  cp "${ios[0]}/test.xml" "$XML_OUTPUT_FILE"
fi
if [ -n "${RDMARPC_VM_KEEP:-}" ]; then
  mkdir -p "$RDMARPC_VM_KEEP"
  if [ "$vms" = 1 ]; then
    cp -a "${ios[0]}/out/." "$RDMARPC_VM_KEEP/"
  else
    for (( i = 0; i < vms; i++ )); do
      role=$(role_of "$i")
      mkdir -p "$RDMARPC_VM_KEEP/$role"
      cp -a "${ios[$i]}/out/." "$RDMARPC_VM_KEEP/$role/"
    done
  fi
fi
echo "rdmavm: guest exit status $rc after $(( $(date +%s) - start )) s" >&2
exit "$rc"
