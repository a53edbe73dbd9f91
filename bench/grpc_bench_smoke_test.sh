#!/usr/bin/env bash
# grpc_bench, gRPC measured beside rdmarpc (bench/run_bench.sh), run end to
# end with small counts in the Soft-RoCE VM: every figure that run_bench.sh
# reads must come, and the counters must say that rdmarpc's rdma:// calls
# went by SEND and its 1 MiB requests by READ. It checks that the benchmark
# measures what it claims, not how fast: speed is run_bench.sh's business.
set -euo pipefail
bench=$1
if [ -z "${RDMARPC_TEST_ADDR:-}" ]; then
  echo "FAIL: no RDMA address: this test needs verbs; run it with make test (tools/vm/run.sh)"
  exit 1
fi
out=$("$bench" --rounds 2 --calls 50 --pulls 3 2>&1) || {
  echo "$out"
  echo "FAIL: grpc_bench exited non-zero"
  exit 1
}
echo "$out"
fail=0
for figure in grpc_small_rtt_p50_us rdmarpc_tcp_small_rtt_p50_us rdmarpc_rdma_small_rtt_p50_us \
    grpc_pull_1mib_mib_per_s rdmarpc_tcp_pull_1mib_mib_per_s rdmarpc_rdma_pull_1mib_mib_per_s \
    rdmarpc_tcp_small_rtt_over_grpc rdmarpc_rdma_small_rtt_over_grpc \
    rdmarpc_tcp_pull_over_grpc rdmarpc_rdma_pull_over_grpc; do
  value=$(echo "$out" | awk -v k="$figure" '$1 == k {print $2}')
  if ! awk -v v="${value:-x}" 'BEGIN {exit !(v + 0 > 0)}'; then
    echo "FAIL: $figure is '${value}', not a positive number"
    fail=1
  fi
done
if ! echo "$out" | grep -qx "grpc_bench_failed 0"; then
  echo "FAIL: a call failed (grpc_bench_failed is not 0)"
  fail=1
fi
counter() { echo "$out" | sed -nE "s/^counters .*[ (]$1[= ]([0-9]+).*/\1/p"; }
# Over rdma://, 3 rounds (one warms up) of 100 small calls and 5 pulls: each
# small call is two SENDs, each pull one READ of its 1 MiB at least.
sends=$(echo "$out" | sed -nE "s/^counters sends=([0-9]+).*/\1/p")
if [ "${sends:-0}" -lt 600 ]; then
  echo "FAIL: ${sends:-no} SENDs; 300 small calls over rdma:// make 600"
  fail=1
fi
bytes_read=$(counter bytes_read)
if [ "${bytes_read:-0}" -lt $((15 << 20)) ]; then
  echo "FAIL: ${bytes_read:-no} bytes READ; 15 pulls of 1 MiB over rdma:// read 15 MiB"
  fail=1
fi
[ $fail -eq 0 ] && echo "PASS"
exit $fail
