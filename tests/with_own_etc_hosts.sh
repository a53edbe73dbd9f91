#!/usr/bin/env bash
# Runs "$@" with an /etc/hosts of its own: an empty file the command may
# write, at the path in $RDMARPC_TEST_HOSTS, for tests of host names that no
# machine has (tests/named_host_test.cc). Names resolve from that file
# alone (an /etc/nsswitch.conf whose hosts line is "files"), so a name not
# in it fails at once, as no name server may answer a test. The bind mounts
# live in a private mount namespace (and a user namespace when not root), so
# nothing outside the command sees them; glibc reads /etc/hosts at each
# lookup, so what the command writes holds at once.
set -euo pipefail
hosts=$(mktemp "${TEST_TMPDIR:-/tmp}/hosts.XXXXXX")
nsswitch=$(mktemp "${TEST_TMPDIR:-/tmp}/nsswitch.XXXXXX")
trap 'rm -f "$hosts" "$nsswitch"' EXIT
grep -v '^hosts:' /etc/nsswitch.conf >"$nsswitch"
echo 'hosts: files' >>"$nsswitch"
export RDMARPC_TEST_HOSTS=$hosts RDMARPC_TEST_NSSWITCH=$nsswitch
namespaces=(--mount --propagation private)
[ "$(id -u)" = 0 ] || namespaces+=(--map-root-user)
unshare "${namespaces[@]}" sh -c 'mount --bind "$RDMARPC_TEST_HOSTS" /etc/hosts &&
  mount --bind "$RDMARPC_TEST_NSSWITCH" /etc/nsswitch.conf && exec "$@"' sh "$@"
