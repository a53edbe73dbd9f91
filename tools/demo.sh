#!/usr/bin/env bash
# The main job: a server and a client exchanging messages over RDMA, on this
# machine's RDMA device or inside a Soft-RoCE VM.
set -euo pipefail
cd "$(dirname "$0")/.."
export RDMARPC_VM_DIR=${RDMARPC_VM_DIR:-$PWD/.cache/vm}
bazel build //transport/rdma:verbs_smoke_test
tools/vm/run.sh bazel-bin/transport/rdma/verbs_smoke_test
