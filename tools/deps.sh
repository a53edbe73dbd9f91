#!/usr/bin/env bash
# Installs what building and testing rdmarpc needs on Debian 12 (with
# --bench, also what the benchmark compares against), then prepares the
# Soft-RoCE VM image. Idempotent: with everything present it installs
# nothing and runs no apt-get update.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  # build
  bazel-bootstrap bazel-rules-java bazel-rules-proto g++ pkg-config
  libprotobuf-dev protobuf-compiler libprotoc-dev libabsl-dev
  libgtest-dev googletest libibverbs-dev librdmacm-dev
  # run time and the Soft-RoCE VM
  rdma-core ibverbs-providers ibverbs-utils rdmacm-utils perftest iproute2
  qemu-system-x86 busybox-static kmod cpio
  # the VM runner's watchdog prints a hung test's stacks with it
  gdb
  # tests/with_own_etc_hosts.sh: unshare and mount
  util-linux mount
  # bench/grpc_bench measures gRPC beside rdmarpc (its smoke test runs in
  # make test)
  libgrpc++-dev protobuf-compiler-grpc
)

# --bench: also what bench/ measures beside rdmarpc (UCX) and with (callgrind,
# and python3 for bench/callgrind_per_call.py).
[ "${1:-}" = --bench ] && packages+=(ucx-utils valgrind python3)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The VM image needs apt's package lists to find the kernel package.
if ! tools/vm/prepare.sh 2>/dev/null; then
  [ "$(id -u)" = 0 ] && apt-get update -q || sudo apt-get update -q
  tools/vm/prepare.sh
fi
