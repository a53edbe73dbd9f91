#!/usr/bin/env bash
# Runs "$2"... without the capability named in $1 (ipc_lock, net_bind_service),
# which root has: as a user's program or a systemd service would run.
# Dropped from the bounding and inheritable sets, the capability is gone
# after the exec, also for root.
#   ipc_lock          RDMA registrations may then pin no more than
#                     RLIMIT_MEMLOCK (`ulimit -l`): tests/locked_memory_test.cc
#   net_bind_service  ports below 1024 cannot be bound, over TCP or rdma_cm:
#                     tests/privileged_port_test.cc
set -euo pipefail
capability=$1
shift
exec setpriv --inh-caps=-"$capability" --bounding-set=-"$capability" -- "$@"
