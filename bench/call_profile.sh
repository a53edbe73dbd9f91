#!/usr/bin/env bash
# Where a small call's instructions go: instructions (self) by function and
# calls by callee, per small call, counted by callgrind in the Soft-RoCE VM
# (or on this machine's RDMA device).
#
#   bench/call_profile.sh [TOP]     (builds, then runs itself under tools/vm/run.sh)
#
# bench/fast_path_ir.sh says how many instructions a frame and a call run;
# this says which functions run them, to find the next cut. Four callgrind
# runs of rpc_bench (with and without small calls, each short and long),
# differenced by bench/callgrind_per_call.py so that start-up and the
# transport's own ping-pong cancel out. The pollers' spinning is left out.
# The caller reuses its response message; RDMARPC_PROFILE_RESPONSES=fresh
# profiles calls that each parse into a new one.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${RDMARPC_VM_ROLE:-}" ]; then
  tools/deps.sh --bench
  bazel build -c opt //bench:rpc_bench
  export RDMARPC_VM_DIR=${RDMARPC_VM_DIR:-$PWD/.cache/vm}
  exec tools/vm/run.sh bench/call_profile.sh "$@"
fi
short=1000
long=3000
dir=$(mktemp -d)
for rpc in true false; do
  for pings in $short $long; do
    echo "callgrind: rpc=$rpc, $pings pings" >&2
    RDMARPC_RDMA_POLL=busy valgrind --tool=callgrind --callgrind-out-file="$dir/$rpc.$pings" \
      --fair-sched=yes bazel-bin/bench/rpc_bench --workers 0 --pulls 0 --rpc="$rpc" \
      --pings "$pings" --responses "${RDMARPC_PROFILE_RESPONSES:-reuse}" >/dev/null 2>&1
  done
done
python3 bench/callgrind_per_call.py "$dir/true.$short" "$dir/true.$long" "$dir/false.$short" \
  "$dir/false.$long" $((long - short)) "${1:-40}"
rm -rf "$dir"
