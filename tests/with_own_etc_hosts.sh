#!/usr/bin/env bash
# Runs "$@" with an /etc/hosts of its own: an empty file the command may
# write, at the path in $RDMARPC_TEST_HOSTS, for tests of host names that no
# machine has (tests/named_host_test.cc). The bind mount lives in a private
# mount namespace (and a user namespace when not root), so nothing outside
# the command sees it; glibc reads /etc/hosts at each lookup, so what the
# command writes holds at once.
set -euo pipefail
hosts=$(mktemp "${TEST_TMPDIR:-/tmp}/hosts.XXXXXX")
trap 'rm -f "$hosts"' EXIT
export RDMARPC_TEST_HOSTS=$hosts
namespaces=(--mount --propagation private)
[ "$(id -u)" = 0 ] || namespaces+=(--map-root-user)
unshare "${namespaces[@]}" sh -c 'mount --bind "$RDMARPC_TEST_HOSTS" /etc/hosts && exec "$@"' \
  sh "$@"
