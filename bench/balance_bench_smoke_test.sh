#!/usr/bin/env bash
# balance_bench end to end with small counts over tcp:// on the host: every
# figure comes for both policies and no call fails. It checks that the
# benchmark measures what it claims, not how fast.
set -uo pipefail
out=$("$1" --calls 100 --threads 3 --slow_us 1000)
rc=$?
echo "$out"
fail=0
if [ "$rc" -ne 0 ]; then
  echo "FAIL: balance_bench exited with $rc"
  fail=1
fi
for policy in round_robin least_requests; do
  for figure in calls_per_s mean_us p50_us p99_us slow_server_share; do
    if ! echo "$out" | grep -qE "^${policy}_${figure} [0-9.]+$"; then
      echo "FAIL: no ${policy}_${figure} figure"
      fail=1
    fi
  done
  if ! echo "$out" | grep -qx "${policy}_failed 0"; then
    echo "FAIL: a call failed under ${policy}"
    fail=1
  fi
done
for ratio in calls_per_s mean p50 p99; do
  if ! echo "$out" | grep -qE "^least_requests_over_round_robin_${ratio} [0-9.]+$"; then
    echo "FAIL: no least_requests_over_round_robin_${ratio} ratio"
    fail=1
  fi
done
exit $fail
