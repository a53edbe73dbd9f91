#!/usr/bin/env bash
# srq_burst run end to end with small counts in the Soft-RoCE VM, into an SRQ
# far smaller than the burst: both setups finish every round and print every
# figure. It checks that the benchmark runs and reports, not how fast.
# (tools/rdma_sh_prelude.sh comes before this.)
set -euo pipefail
bench=$1
out=$(run_or_fail srq_burst "$bench" --connections 4 --frames 8 --receive_slots 16 --rounds 2) ||
  exit 1
echo "$out"
expect_figures "$out" srq_burst_frames srq_burst_default_wait_round_p50_ms \
  srq_burst_default_wait_round_max_ms srq_burst_long_wait_round_p50_ms \
  srq_burst_long_wait_round_max_ms srq_burst_long_over_default_p50
for setup in default long; do
  if ! echo "$out" | grep -qE "^srq_burst_${setup}_wait_rnr_naks_per_round [0-9.]+$"; then
    echo "FAIL: no RNR NAK count for the $setup setup (rxe counts them)"
    fail=1
  fi
done
[ "$fail" = 0 ] && echo "PASS"
exit "$fail"
