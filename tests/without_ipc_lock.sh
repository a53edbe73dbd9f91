#!/usr/bin/env bash
# Runs "$@" without CAP_IPC_LOCK, which root has and which lifts the
# locked-memory limit: its RDMA registrations may then pin no more than
# RLIMIT_MEMLOCK (`ulimit -l`), as those of a user's program or a systemd
# service may (tests/locked_memory_test.cc). Dropped from the bounding and
# inheritable sets, the capability is gone after the exec, also for root.
set -euo pipefail
exec setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock -- "$@"
