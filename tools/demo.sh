#!/usr/bin/env bash
# The main job: an Echo server and client exchanging small (SEND into the SRQ)
# and large (RDMA READ) messages over rdma://, on this machine's RDMA device or
# inside a Soft-RoCE VM. Prints the device, latencies and counters.
set -euo pipefail
cd "$(dirname "$0")/.."
export RDMARPC_VM_DIR=${RDMARPC_VM_DIR:-$PWD/.cache/vm}
bazel build -c opt //examples:echo_demo
tools/vm/run.sh bazel-bin/examples/echo_demo "$@"
