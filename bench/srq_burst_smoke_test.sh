#!/usr/bin/env bash
# srq_burst run end to end with small counts in the Soft-RoCE VM, into an SRQ
# far smaller than the burst: both setups finish every round and print every
# figure. It checks that the benchmark runs and reports, not how fast.
set -euo pipefail
bench=$1
if [ -z "${RDMARPC_TEST_ADDR:-}" ]; then
  echo "FAIL: no RDMA address: this test needs verbs; run it with make test (tools/vm/run.sh)"
  exit 1
fi
out=$("$bench" --connections 4 --frames 8 --receive_slots 16 --rounds 2 2>&1) || {
  echo "$out"
  echo "FAIL: srq_burst exited non-zero"
  exit 1
}
echo "$out"
fail=0
for figure in srq_burst_frames srq_burst_default_wait_round_p50_ms \
    srq_burst_default_wait_round_max_ms srq_burst_long_wait_round_p50_ms \
    srq_burst_long_wait_round_max_ms srq_burst_long_over_default_p50; do
  value=$(echo "$out" | awk -v k="$figure" '$1 == k {print $2}')
  if ! awk -v v="${value:-x}" 'BEGIN {exit !(v + 0 > 0)}'; then
    echo "FAIL: $figure is '${value}', not a positive number"
    fail=1
  fi
done
for setup in default long; do
  if ! echo "$out" | grep -qE "^srq_burst_${setup}_wait_rnr_naks_per_round [0-9.]+$"; then
    echo "FAIL: no RNR NAK count for the $setup setup (rxe counts them)"
    fail=1
  fi
done
[ "$fail" = 0 ] && echo "PASS"
exit "$fail"
