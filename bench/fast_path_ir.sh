#!/usr/bin/env bash
# Instructions per frame on the RDMA transport's fast path, and per small
# call in the runtime above it, counted by callgrind in the Soft-RoCE VM (or
# on this machine's RDMA device).
#
#   bench/fast_path_ir.sh      (builds, then runs itself under tools/vm/run.sh)
#
# Why: under the emulator a round trip's time grows with the user code run
# between posts by far more than that code's own time (see README
# "Benchmarks"), and timings are noisy, while instruction counts are exact.
# A change to the send or receive path shows here first. The counts are
# inclusive of what the path calls (the provider's post, mutexes, counters)
# and exclude the spinning of pollers that found nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${RDMARPC_VM_ROLE:-}" ]; then
  tools/deps.sh --bench
  bazel build -c opt //bench:rpc_bench
  export RDMARPC_VM_DIR=${RDMARPC_VM_DIR:-$PWD/.cache/vm}
  exec tools/vm/run.sh bench/fast_path_ir.sh
fi
pings=${RDMARPC_IR_PINGS:-1000}
out=$(mktemp)
RDMARPC_RDMA_POLL=busy valgrind --tool=callgrind --callgrind-out-file="$out" --fair-sched=yes \
  bazel-bin/bench/rpc_bench --rpc=false --pulls 0 --pings "$pings" 2>&1 | grep transport_rtt
# Inclusive Ir of one function, picked by a unique part of its name.
incl() {
  callgrind_annotate --inclusive=yes --threshold=100 "$out" 2>/dev/null |
    awk -v f="$1" '!found && index($0, f) {gsub(",", "", $1); print $1; found = 1}'
}
# The ping-pong makes 100 warm-up round trips, then $pings; each is two frames.
frames=$(( 2 * (pings + 100) ))
send=$(incl "RdmaConnection::Send(")
completions=$(incl "Endpoint::HandleCompletion(")
observers=$(( $(incl "Responder::OnMessage(") + $(incl "ResponseSink::OnMessage(") ))
refill=$(incl "Endpoint::RefillSrq()")
awk -v f="$frames" -v s="$send" -v c="$completions" -v o="$observers" -v r="$refill" 'BEGIN {
  printf "ir_per_frame_send %.0f\n", s / f;
  printf "ir_per_frame_receive %.0f   (completion to observer, its own work excluded)\n", (c - o) / f;
  printf "ir_per_frame_srq_refill %.0f\n", r / f;
  printf "ir_per_round_trip %.0f   (two frames)\n", 2 * (s + c - o + r) / f;
}'
# The runtime's share of a small call: a second run, of calls only as far as
# the figures go (its transport pings are not counted here), with inline
# handlers as in run_bench.sh. Each figure includes the transport work it
# calls: the request's SEND in Start, the response's SEND in the server's.
# The caller reuses its response message (rpc_bench's headline figure); a
# third run with a fresh one per call adds what parsing into it allocates.
calls=$(( pings + 100 ))
for responses in reuse fresh; do
  RDMARPC_RDMA_POLL=busy valgrind --tool=callgrind --callgrind-out-file="$out" --fair-sched=yes \
    bazel-bin/bench/rpc_bench --workers 0 --pulls 0 --pings "$pings" --responses "$responses" \
    2>&1 | grep 'rpc_small.*_rtt_p50'
  start=$(incl "Channel::Start(")
  server=$(incl "Server::OnMessage(")
  response=$(incl "Channel::OnMessage(")
  if [ "$responses" = fresh ]; then
    awk -v n="$calls" -v a="$start" -v b="$server" -v c="$response" 'BEGIN {
      printf "ir_per_call_fresh_response %.0f   (the same, parsing into a new response message)\n", (a + b + c) / n;
    }'
    continue
  fi
  awk -v n="$calls" -v a="$start" -v b="$server" -v c="$response" 'BEGIN {
    printf "ir_per_call_client_start %.0f   (serialize, track, SEND)\n", a / n;
    printf "ir_per_call_server %.0f   (dispatch, handler, response SEND)\n", b / n;
    printf "ir_per_call_client_response %.0f   (match, parse, wake the caller)\n", c / n;
    printf "ir_per_call %.0f   (the three above; the receive completions are not in it)\n", (a + b + c) / n;
  }'
done
rm -f "$out"
