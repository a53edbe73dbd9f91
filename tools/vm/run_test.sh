#!/usr/bin/env bash
# The VM runner's promises (tools/vm/run.sh, header): the command's exit
# status comes back, and when it fails, what the guest's kernel logged while
# it ran (but not the boot's messages); a command that hangs is shown (its
# processes' stacks) and killed before the time limit, with status 124; a
# slow boot is reported; a guest that does not boot in time has its kernel's
# log, stacks and vCPUs shown and is booted again once, then the runner gives
# up with 97; one that gets there while the runner looks into it runs on.
# Boots a Soft-RoCE VM five times; needs the image (make test prepares it).
set -uo pipefail
run=$1
fail=0
check() {  # what, got, expected
  if [ "$2" != "$3" ]; then echo "FAIL: $1: got $2, expected $3"; fail=1; fi
}
has() {  # what, output, pattern
  if ! grep -qE -- "$3" <<<"$2"; then echo "FAIL: $1: no line matching /$3/"; fail=1; fi
}

# The kernel's message comes in the middle of a line of the command's (sent,
# then half a second for the serial port to carry it): it is still moved to
# the kernel's lines.
# A time limit that leaves room for a real stuck boot and the second one.
out=$("$run" --timeout 300 bash -c 'echo "in the guest as $RDMARPC_VM_ROLE"
  printf "a line that the kernel cuts: "; sleep 0.5
  echo "run_test: logged by the kernel" > /dev/kmsg; echo "its end"; exit 3' 2>&1)
check "a command's exit status" $? 3
has "the command's output" "$out" '^in the guest as single$'
has "the command's line up to the kernel's" "$out" '^a line that the kernel cuts: $'
has "the kernel's message, after a failure" "$out" '^rdmavm-kernel: \[ *[0-9.]+\] run_test: logged by the kernel$'
if grep -q 'Linux version' <<<"$out"; then echo "FAIL: the boot's kernel messages are in the output"; fail=1; fi

# Every boot counts as slow here, so that the report shows (this command runs
# long enough for the runner to see that it started).
out=$(RDMARPC_VM_WATCHDOG=15 RDMARPC_VM_SLOW_BOOT=0 "$run" --timeout 240 bash -c 'sleep 1000; echo "sleep returned"' 2>&1)
rc=$?
echo "$out"
check "a hung command's status" "$rc" 124
has "the slow boot reported" "$out" '^rdmavm: INFRA: slow boot: the guests reached their command after ~[0-9]+ s'
has "the watchdog's announcement" "$out" 'WATCHDOG: still running after 15 s'
has "the hung process named" "$out" 'WATCHDOG: process [0-9]+: sleep 1000'
has "the hung process's stack" "$out" '^#[0-9]+ .*nanosleep'
has "the kill" "$out" 'WATCHDOG: killed'
if grep -qx "sleep returned" <<<"$out"; then echo "FAIL: the command went on after the watchdog"; fail=1; fi

out=$(RDMARPC_VM_FAKE_STUCK_BOOT=1 RDMARPC_VM_BOOT_TIMEOUT=25 "$run" --timeout 200 bash -c 'echo "ran"' 2>&1)
rc=$?
echo "$out"
check "status when the guest never boots" "$rc" 97
has "the stuck boot's kernel log" "$out" 'guest vm0 is stuck in boot; its kernel.s log from /init on'
has "init's last step in it" "$out" '^rdmavm-kernel: .*rdmavm-init: io share mounted$'
has "the kernel's stacks" "$out" '^rdmavm-kernel: .*NMI backtrace for cpu'
has "the second boot" "$out" 'booting again, once'
has "giving up" "$out" 'did not boot twice in a row'
has "the stuck vCPUs, named" "$out" '^rdmavm-vcpu: CPU#0 RIP=native_safe_halt\+0x[0-9a-f]+ HLT=1$'
has "their stacks, named" "$out" '^rdmavm-vcpu: CPU#1 stack: .* do_idle\+0x[0-9a-f]+ '
if grep -q 'rdmavm-init: running the command' <<<"$out"; then echo "FAIL: a stuck guest ran its command"; fail=1; fi

# A guest that reaches its command while the runner looks into why it had
# not (here: once the runner asked for its stacks; a limit that any boot here
# reaches its command in, ~6 s, ~30 s under load) is slow, not stuck: it runs.
out=$(RDMARPC_VM_FAKE_STUCK_BOOT=late RDMARPC_VM_BOOT_TIMEOUT=60 "$run" --timeout 200 bash -c 'echo "ran"' 2>&1)
rc=$?
echo "$out"
check "status when the guest booted late" "$rc" 0
has "the late guest's command" "$out" '^ran$'
has "the late boot reported" "$out" '^rdmavm: INFRA: slow boot: the guests reached their command after ~(6[0-9]|7[0-9]) s'
if grep -qE 'is stuck in boot|booting again' <<<"$out"; then echo "FAIL: a late guest was taken for stuck"; fail=1; fi

[ "$fail" = 0 ] && echo "PASS: exit status and kernel messages kept, hang shown and killed, slow boot reported, stuck boot shown and retried once, late boot run"
exit "$fail"
