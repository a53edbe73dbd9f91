#!/usr/bin/env bash
# rpc_bench, the benchmark behind the RDMA transport's speed figures
# (bench/run_bench.sh), run end to end with small counts in the Soft-RoCE VM:
# every figure that run_bench.sh reads must come, and the counters must say
# that the small calls went by SEND, written in place, the medium ones by
# SENDs too large to go inline, and the 1 MiB requests by READ. It checks
# that the benchmark measures what it claims, not how fast: speed is
# run_bench.sh's business. (tools/rdma_sh_prelude.sh comes before this.)
set -euo pipefail
bench=$1
out=$(RDMARPC_RDMA_POLL=busy run_or_fail rpc_bench "$bench" --pings 200 --pulls 8 --in_flight 4 \
  --workers 0 --medium_calls 200 --medium_bytes 1024 --medium_in_flight 8) || exit 1
echo "$out"
expect_figures "$out" transport_rtt_p50_us rpc_small_rtt_p50_us \
  rpc_small_fresh_response_rtt_p50_us rpc_medium_1024b_calls_per_s \
  transport_pull_1mib_mib_per_s rpc_pull_1mib_mib_per_s rpc_pull_attachment_1mib_mib_per_s
if ! echo "$out" | grep -qx "rpc_failed 0"; then
  echo "FAIL: a call failed (rpc_failed is not 0)"
  fail=1
fi
# 600 small calls (200 measured and 100 for warm-up, with a reused and with a
# new response message): each sends its request in place, and its response.
expect "SENDs written in place (600 small calls)" "$(counter "in place " "$out")" -ge 1200
# 200 medium calls: a request and a response each, neither fits inline
# (nothing else here sends a frame that large).
sends=$(counter sends= "$out")
inline=$(counter "inline " "$out")
expect "SENDs not inline (200 medium calls)" "$((${sends:-0} - ${inline:-0}))" -ge 400
# 8 pulls each straight on the transport, in a bytes field, as an attachment.
expect "bytes READ (24 pulls of 1 MiB)" "$(counter bytes_read= "$out")" -ge $((24 << 20))
# Small calls taking turns with a bare verbs ping-pong in the same process:
# its three figures come, and busy pollers (which would never leave the
# ping-pong a CPU) are refused rather than measured.
inter=$(run_or_fail "rpc_bench --interleaved_blocks" "$bench" --pings 0 --pulls 0 --workers 0 \
  --interleaved_blocks 2) || fail=1
echo "$inter" | grep '^interleaved' || true
expect_figures "$inter" interleaved_bare_verbs_rtt_p50_us interleaved_rpc_small_rtt_p50_us \
  interleaved_rpc_small_over_bare_verbs
if RDMARPC_RDMA_POLL=busy "$bench" --pings 0 --pulls 0 --interleaved_blocks 1 >/dev/null 2>&1; then
  echo "FAIL: --interleaved_blocks ran with RDMARPC_RDMA_POLL=busy"
  fail=1
fi
[ "$fail" = 0 ] && echo "PASS: every figure came (interleaved ones too); small calls in place, medium ones not inline, large ones by READ"
exit $fail
