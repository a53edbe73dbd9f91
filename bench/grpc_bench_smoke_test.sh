#!/usr/bin/env bash
# grpc_bench, gRPC measured beside rdmarpc (bench/run_bench.sh), run end to
# end with small counts in the Soft-RoCE VM: every figure that run_bench.sh
# reads must come, and the counters must say that rdmarpc's rdma:// calls
# went by SEND and its 1 MiB requests by READ. It checks that the benchmark
# measures what it claims, not how fast: speed is run_bench.sh's business.
# (tools/rdma_sh_prelude.sh comes before this.)
set -euo pipefail
bench=$1
out=$(run_or_fail grpc_bench "$bench" --rounds 2 --calls 50 --pulls 4 --in_flight 2) || exit 1
echo "$out"
expect_figures "$out" grpc_small_rtt_p50_us rdmarpc_tcp_small_rtt_p50_us \
  rdmarpc_rdma_small_rtt_p50_us grpc_pull_1mib_mib_per_s rdmarpc_tcp_pull_1mib_mib_per_s \
  rdmarpc_rdma_pull_1mib_mib_per_s rdmarpc_tcp_small_rtt_over_grpc \
  rdmarpc_rdma_small_rtt_over_grpc rdmarpc_tcp_pull_over_grpc rdmarpc_rdma_pull_over_grpc \
  grpc_small_in_flight_calls_per_s rdmarpc_tcp_small_in_flight_calls_per_s \
  rdmarpc_rdma_small_in_flight_calls_per_s grpc_pull_in_flight_mib_per_s \
  rdmarpc_tcp_pull_in_flight_mib_per_s rdmarpc_rdma_pull_in_flight_mib_per_s \
  rdmarpc_tcp_small_in_flight_over_grpc rdmarpc_rdma_small_in_flight_over_grpc \
  rdmarpc_tcp_pull_in_flight_over_grpc rdmarpc_rdma_pull_in_flight_over_grpc \
  grpc_small_async_calls_per_s rdmarpc_tcp_small_async_calls_per_s \
  rdmarpc_rdma_small_async_calls_per_s grpc_pull_async_mib_per_s \
  rdmarpc_tcp_pull_async_mib_per_s rdmarpc_rdma_pull_async_mib_per_s \
  rdmarpc_tcp_small_async_over_grpc rdmarpc_rdma_small_async_over_grpc \
  rdmarpc_tcp_pull_async_over_grpc rdmarpc_rdma_pull_async_over_grpc
if ! echo "$out" | grep -qx "grpc_bench_failed 0"; then
  echo "FAIL: a call failed (grpc_bench_failed is not 0)"
  fail=1
fi
# Over rdma://, 3 rounds (one warms up), each of 100 small calls and 6 pulls
# one at a time, as many two at a time from two threads and as many two at
# a time asynchronously: each small call is two SENDs, each pull one READ
# of its 1 MiB at least.
expect "SENDs (900 small calls over rdma://)" "$(counter sends= "$out")" -ge 1800
expect "bytes READ (54 pulls of 1 MiB over rdma://)" "$(counter bytes_read= "$out")" -ge $((54 << 20))
[ $fail -eq 0 ] && echo "PASS"
exit $fail
