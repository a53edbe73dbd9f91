#!/usr/bin/env bash
# Where the time of one round trip goes, stage by stage: a bare verbs
# ping-pong (pingpong_probe, what ib_send_lat measures), a transport frame
# and a small call, each timed at marks inside the processes (base/
# stage_trace.h), in the Soft-RoCE VM (or on this machine's RDMA device),
# with ib_send_lat in the same boot for reference.
#
#   bench/stage_timeline.sh [ROUNDS]     (builds, then runs itself under tools/vm/run.sh)
#
# The binaries are built with RDMARPC_STAGE_TRACE defined, in their own
# output directory (--platform_suffix), so the usual build keeps its cache
# and its bazel-bin. Where fast_path_ir.sh and call_profile.sh count
# instructions, this says which stages the time is in: the posts' system
# calls, the wait for the peer's poll, or user code on either side.
set -euo pipefail
cd "$(dirname "$0")/.."
flags=(-c opt --copt=-DRDMARPC_STAGE_TRACE --platform_suffix=stages)
if [ -z "${RDMARPC_VM_ROLE:-}" ]; then
  tools/deps.sh --bench
  bazel build "${flags[@]}" --symlink_prefix=/ //bench:rpc_bench //transport/rdma:pingpong_probe
  RDMARPC_STAGE_BIN=$(bazel info "${flags[@]}" bazel-bin)
  export RDMARPC_STAGE_BIN
  export RDMARPC_VM_DIR=${RDMARPC_VM_DIR:-$PWD/.cache/vm}
  exec tools/vm/run.sh bench/stage_timeline.sh "$@"
fi
ip=$RDMARPC_TEST_ADDR
dev=$(rdma link show | awk '/state ACTIVE/ {split($2, a, "/"); print a[1]; exit}')
bin=$RDMARPC_STAGE_BIN
export RDMARPC_STAGE_DIR
RDMARPC_STAGE_DIR=$(mktemp -d)
# 130 bytes: what one small call puts on the wire (see run_bench.sh).
send_lat() {
  timeout 120 ib_send_lat -d "$dev" -R -n 5000 -s 130 >/dev/null 2>&1 &
  sleep 1
  timeout 120 ib_send_lat -d "$dev" -R -n 5000 -s 130 "$ip" 2>/dev/null | awk '$1 == 130 {print $5}'
  wait || true
}
for r in $(seq "${1:-2}"); do
  echo "== round $r: ib_send_lat $(send_lat) us one-way"
  "$bin/transport/rdma/pingpong_probe" --address "$ip" --size 130 | grep bare_rtt
  RDMARPC_RDMA_POLL=busy "$bin/bench/rpc_bench" --pulls 0 --workers 0 --pings 3000 \
    --responses reuse 2>/dev/null | grep rtt_p50
  python3 bench/stage_timeline.py "$RDMARPC_STAGE_DIR"/{probe_bare,transport,rpc_small}.stages
done
rm -rf "$RDMARPC_STAGE_DIR"
