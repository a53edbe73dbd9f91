#!/usr/bin/env bash
# Runs every test: the host tests with Bazel, then the RDMA tests under
# tools/vm/run.sh (this machine's RDMA device, or Soft-RoCE VMs), then again
# under the sanitizers: host tests with ASan and TSan, RDMA tests with ASan
# (TSan cannot see the NIC's writes as synchronization). Extra arguments go to
# every `bazel test`. RDMARPC_TEST_SANITIZERS=0 skips the sanitizer rounds.
# Ends with one line: "N passed, N failed" (counting Bazel test runs).
set -uo pipefail
cd "$(dirname "$0")/.."

start=$(date +%s)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export RDMARPC_VM_DIR=${RDMARPC_VM_DIR:-$PWD/.cache/vm}
common=(--test_env=RDMARPC_VM_DIR --test_env=RDMARPC_VM --test_env=RDMARPC_TEST_ADDR "$@")

status=0
run() {
  echo "== bazel test $*"
  bazel test "${common[@]}" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  # 4: no test matched the filter, which is not a failure.
  [ "$rc" = 0 ] || [ "$rc" = 4 ] || status=1
}

run //... --test_tag_filters=-rdma,-rdma_two_vms
run //... --test_tag_filters=rdma --test_output=all --run_under=//tools/vm:run
run //... --test_tag_filters=rdma_two_vms --test_output=all "--run_under=//tools/vm:run --vms 2"
if [ "${RDMARPC_TEST_SANITIZERS:-1}" != 0 ]; then
  run --config=asan //... --test_tag_filters=-rdma,-rdma_two_vms
  run --config=tsan //... --test_tag_filters=-rdma,-rdma_two_vms
  run --config=asan //... --test_tag_filters=rdma --run_under=//tools/vm:run
fi

passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|INCOMPLETE|FLAKY)' "$log")
echo
echo "test: done in $(( $(date +%s) - start )) s"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ] || status=1
exit $status
