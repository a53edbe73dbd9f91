#!/usr/bin/env bash
# rpc_bench, the benchmark behind the RDMA transport's speed figures
# (bench/run_bench.sh), run end to end with small counts in the Soft-RoCE VM:
# every figure that run_bench.sh reads must come, and the counters must say
# that the small calls went by SEND, written in place, the medium ones by
# SENDs too large to go inline, and the 1 MiB requests by READ. It checks that the benchmark measures what it claims,
# not how fast: speed is run_bench.sh's business.
set -euo pipefail
bench=$1
if [ -z "${RDMARPC_TEST_ADDR:-}" ]; then
  echo "FAIL: no RDMA address: this test needs verbs; run it with make test (tools/vm/run.sh)"
  exit 1
fi
out=$(RDMARPC_RDMA_POLL=busy "$bench" --pings 200 --pulls 8 --in_flight 4 --workers 0 \
  --medium_calls 200 --medium_bytes 1024 --medium_in_flight 8 2>&1) || {
  echo "$out"
  echo "FAIL: rpc_bench exited non-zero"
  exit 1
}
echo "$out"
fail=0
for figure in transport_rtt_p50_us rpc_small_rtt_p50_us rpc_small_fresh_response_rtt_p50_us \
    rpc_medium_1024b_calls_per_s transport_pull_1mib_mib_per_s rpc_pull_1mib_mib_per_s \
    rpc_pull_attachment_1mib_mib_per_s; do
  value=$(echo "$out" | awk -v k="$figure" '$1 == k {print $2}')
  if ! awk -v v="${value:-x}" 'BEGIN {exit !(v + 0 > 0)}'; then
    echo "FAIL: $figure is '${value}', not a positive number"
    fail=1
  fi
done
if ! echo "$out" | grep -qx "rpc_failed 0"; then
  echo "FAIL: a call failed (rpc_failed is not 0)"
  fail=1
fi
counter() { echo "$out" | sed -nE "s/^counters .*[ (]$1[= ]([0-9]+).*/\1/p"; }
# 600 small calls (200 measured and 100 for warm-up, with a reused and with a
# new response message): each sends its request in place, and its response.
in_place=$(counter "in place")
if [ "${in_place:-0}" -lt 1200 ]; then
  echo "FAIL: ${in_place:-no} SENDs written in place; 600 small calls make 1200"
  fail=1
fi
# 200 medium calls: a request and a response each, neither fits inline
# (nothing else here sends a frame that large).
sends=$(echo "$out" | sed -nE "s/^counters sends=([0-9]+).*/\1/p")
inline=$(counter inline)
if [ $((${sends:-0} - ${inline:-0})) -lt 400 ]; then
  echo "FAIL: $((${sends:-0} - ${inline:-0})) SENDs not inline; 200 medium calls make 400"
  fail=1
fi
# 8 pulls each straight on the transport, in a bytes field, as an attachment.
bytes_read=$(counter bytes_read)
if [ "${bytes_read:-0}" -lt $((24 << 20)) ]; then
  echo "FAIL: ${bytes_read:-no} bytes READ; 24 pulls of 1 MiB need $((24 << 20))"
  fail=1
fi
# Small calls taking turns with a bare verbs ping-pong in the same process:
# its three figures come, and busy pollers (which would never leave the
# ping-pong a CPU) are refused rather than measured.
inter=$("$bench" --pings 0 --pulls 0 --workers 0 --interleaved_blocks 2 2>&1) || {
  echo "$inter"
  echo "FAIL: rpc_bench --interleaved_blocks exited non-zero"
  fail=1
}
echo "$inter" | grep '^interleaved' || true
for figure in interleaved_bare_verbs_rtt_p50_us interleaved_rpc_small_rtt_p50_us \
    interleaved_rpc_small_over_bare_verbs; do
  value=$(echo "$inter" | awk -v k="$figure" '$1 == k {print $2}')
  if ! awk -v v="${value:-x}" 'BEGIN {exit !(v + 0 > 0)}'; then
    echo "FAIL: $figure is '${value}', not a positive number"
    fail=1
  fi
done
if RDMARPC_RDMA_POLL=busy "$bench" --pings 0 --pulls 0 --interleaved_blocks 1 >/dev/null 2>&1; then
  echo "FAIL: --interleaved_blocks ran with RDMARPC_RDMA_POLL=busy"
  fail=1
fi
[ "$fail" = 0 ] && echo "PASS: every figure came (interleaved ones too); small calls in place, medium ones not inline, large ones by READ"
exit $fail
