#!/usr/bin/env bash
# Line coverage of the project's own code by its tests, to find what no test
# reaches (error paths above all). Not part of CI: it rebuilds everything
# with gcov instrumentation in an output base of its own (the usual build and
# its cache stay as they are), runs the RDMA tests in one boot of the
# Soft-RoCE VM (or on this machine's device) and the host tests with Bazel,
# then prints each file's line coverage and writes every line no test ran to
# .cache/coverage/uncovered.txt.
#
#   tools/coverage.sh             everything (~10 min on 2 cores)
#   tools/coverage.sh --host      host tests only (no VM)
#   tools/coverage.sh --report    the report again, from the last run's counts
#
# `bazel coverage` gives empty reports with Debian's Bazel 4 and gcc 12, hence
# this. The two-VM test is left out (its path is also in the one-VM tests).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-all}
out=$PWD/.cache/coverage
# Not under /tmp: the VM has its own /tmp, and must see the test binaries.
base=${RDMARPC_COVERAGE_BASE:-$HOME/.cache/bazel/rdmarpc-coverage}
# No bazel-* links: they would point the usual build's at this output base.
gcov_flags=(--spawn_strategy=local --copt=--coverage --copt=-O0 --linkopt=--coverage
  --symlink_prefix=/)
bz() { bazel --output_base="$base" "$@"; }
# Not //...: that would walk the usual build's bazel-* links, which this
# output base does not know as its own.
targets=(//:all)
for d in */; do
  case "$d" in bazel-*) continue ;; esac
  [ ! -f "$d/BUILD" ] || targets+=("//${d%/}/...")
done

# Every test writes its counts under $counts (GCOV_PREFIX; libgcov adds to
# what is there): objects name their counts /proc/self/cwd/bazel-out/...,
# relative to whichever directory the test runs in.
counts=$out/counts
if [ "$mode" != --report ]; then
  tools/deps.sh
  bz build "${gcov_flags[@]}" "${targets[@]}"
  bin=$(bz info "${gcov_flags[@]}" bazel-bin)
  rm -rf "$counts"
  mkdir -p "$counts"
  if [ "$mode" != --host ]; then
    # The RDMA tests, one after another in one boot; the guest writes its
    # counts to the VM's out directory, copied to $counts at the end.
    universe=${targets[0]}
    for t in "${targets[@]:1}"; do universe+=" + $t"; done
    rdma="attr(tags, '[\[ ]rdma[,\]]', $universe)"
    path() { local l=${1#//}; echo "${l%%:*}/${l##*:}"; }
    script=$out/vm_tests.sh
    {
      echo 'export GCOV_PREFIX=$RDMARPC_VM_OUT GCOV_PREFIX_STRIP=3'
      echo 'failed=0'
      for t in $(bz query "kind(cc_test, $rdma)" 2>/dev/null); do
        p=$(path "$t")
        echo "echo \"coverage: $t\""
        echo "(cd $bin/$p.runfiles/rdmarpc && $bin/$p) || failed=1"
      done
      # A script test runs the one program it depends on, named by its
      # runfiles path (args = ["$(location ...)"]).
      for t in $(bz query "kind(sh_test, $rdma)" 2>/dev/null); do
        p=$(path "$t")
        program=$(path "$(bz query "kind(cc_binary, labels(data, $t))" 2>/dev/null)")
        echo "echo \"coverage: $t\""
        echo "(cd $bin/$p.runfiles/rdmarpc && $bin/$p $program) || failed=1"
      done
      echo 'exit $failed'
    } > "$script"
    export RDMARPC_VM_DIR=${RDMARPC_VM_DIR:-$PWD/.cache/vm}
    RDMARPC_VM_KEEP=$counts tools/vm/run.sh bash "$script" \
      || echo "coverage: an RDMA test failed (its counts still count)" >&2
  fi
  bz test "${gcov_flags[@]}" --nocache_test_results --test_tag_filters=-rdma,-rdma_two_vms \
    --test_env=GCOV_PREFIX="$counts" --test_env=GCOV_PREFIX_STRIP=3 "${targets[@]}" \
    || echo "coverage: a host test failed (its counts still count)" >&2
  # The protoc plugin runs while Bazel builds, uninstrumented: run the
  # instrumented one over every .proto here (some are refused on purpose).
  gen=$(mktemp -d)
  for proto in $(git ls-files '*.proto'); do
    GCOV_PREFIX=$counts GCOV_PREFIX_STRIP=3 protoc -I. --plugin=protoc-gen-rdmarpc="$bin/codegen/protoc-gen-rdmarpc" \
      --rdmarpc_out="$gen" "$proto" 2>/dev/null || true
  done
  rm -rf "$gen"
fi
execroot=$(bz info "${gcov_flags[@]}" execution_root)
# gcov wants the counts beside the objects' notes.
find "$execroot/bazel-out" -name '*.gcda' -delete
(cd "$counts" && find . -name '*.gcda' -exec cp --parents {} "$execroot/" \;)
python3 tools/coverage_report.py "$execroot" "$out/uncovered.txt"
