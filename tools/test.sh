#!/usr/bin/env bash
# Runs every test: the host tests with Bazel, then the RDMA tests under
# tools/vm/run.sh (this machine's RDMA device, or Soft-RoCE VMs), then again
# under the sanitizers: host tests with ASan+UBSan and TSan, RDMA tests with
# ASan+UBSan and TSan (told what a SEND orders by
# transport/rdma/sanitizer_sync.h; up to 20 minutes a test, as TSan in the
# emulator runs the longest, rdma_transport_test, in ~5); tests tagged
# no_sanitizer run once: those that build no C++ of ours, those that
# link a library built without the sanitizers (gRPC: TSan then reports its
# internals), and those that set an address-space limit, which leaves the
# sanitizers no room for their shadow memory. Extra
# arguments go to every `bazel test`. RDMARPC_TEST_SANITIZERS=0 skips the
# sanitizer rounds.
# Ends with the tail of each failed test's log, one line naming each failed
# test and its round, each round's time, and then "N passed, N failed"
# (counting Bazel test runs): CI shows only the last lines, and they must say
# what broke, and where the time went when CI nears its limit.
set -uo pipefail
cd "$(dirname "$0")/.."

start=$(date +%s)
log=$(mktemp)
export RDMARPC_VM_DIR=${RDMARPC_VM_DIR:-$PWD/.cache/vm}
common=(--test_env=RDMARPC_VM_DIR --test_env=RDMARPC_VM --test_env=RDMARPC_TEST_ADDR "$@")

failures=$(mktemp)
excerpts=$(mktemp)
times=$(mktemp)
trap 'rm -f "$log" "$failures" "$excerpts" "$times"' EXIT
bad='(FAILED|TIMEOUT|NO STATUS|INCOMPLETE|FLAKY)'

status=0
run() {
  echo "== bazel test $*"
  local round began=$SECONDS
  round=$(mktemp)
  bazel test "${common[@]}" "$@" 2>&1 | tee "$round"
  local rc=${PIPESTATUS[0]}
  printf '%6d s  bazel test %s\n' $((SECONDS - began)) "$*" >>"$times"
  cat "$round" >>"$log"
  # 4: no test matched the filter, which is not a failure.
  [ "$rc" = 0 ] || [ "$rc" = 4 ] || status=1
  # bazel-testlogs points at this round's configuration only until the next
  # round, so the logs of its failures are read now.
  local target
  for target in $(grep -oE "^//[^ ]+ +(\(cached\) )?$bad" "$round" | cut -d' ' -f1); do
    echo "$target  (bazel test $*)" >>"$failures"
    local path=${target#//}
    path=bazel-testlogs/${path/://}/test.log
    {
      echo "---- $target (bazel test $*): its failures, then the end of its log"
      if [ -f "$path" ]; then
        grep -E 'Failure|FAILED|Sanitizer|Check failed|timed out|WATCHDOG: (still|process)' "$path" | head -n 20
        echo "...."
        tail -n 15 "$path"
      else
        echo "(no log at $path)"
      fi
    } >>"$excerpts"
  done
  rm -f "$round"
}

run //... --test_tag_filters=-rdma,-rdma_two_vms
run //... --test_tag_filters=rdma --test_output=all --run_under=//tools/vm:run
run //... --test_tag_filters=rdma_two_vms --test_output=all "--run_under=//tools/vm:run --vms 2"
if [ "${RDMARPC_TEST_SANITIZERS:-1}" != 0 ]; then
  run --config=asan --config=ubsan //... --test_tag_filters=-rdma,-rdma_two_vms,-no_sanitizer
  run --config=tsan //... --test_tag_filters=-rdma,-rdma_two_vms,-no_sanitizer
  run --config=asan --config=ubsan //... --test_tag_filters=rdma,-no_sanitizer --run_under=//tools/vm:run
  run --config=tsan //... --test_tag_filters=rdma,-no_sanitizer --run_under=//tools/vm:run --test_timeout=1200
fi

passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE "^//[^ ]+ +(\(cached\) )?$bad" "$log")
echo
cat "$excerpts"
if [ -s "$failures" ]; then
  echo
  echo "failed:"
  sed 's/^/  /' "$failures"
fi
echo
echo "rounds:"
cat "$times"
echo "test: done in $(( $(date +%s) - start )) s"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ] || status=1
exit $status
