"""rdma_cc_test and rdma_sh_test: tests that need real RDMA verbs.

Tagged "rdma" (or "rdma_two_vms" with two_vms = True) so that `make test` runs
it under tools/vm/run.sh: on this machine's RDMA device or in a Soft-RoCE VM.
"local" because the VM shares the host's real / (not a sandbox view), and
"exclusive" because a TCG VM wants both cores. A plain `bazel test //...` on a
machine without RDMA runs it directly, where it FAILS with a message saying to
use `make test` (see transport/rdma/testing/rdma_test_env.h).
"""

def _rdma_tags(tags, two_vms):
    return tags + ["rdma_two_vms" if two_vms else "rdma", "local", "exclusive"]

def rdma_cc_test(name, two_vms = False, tags = [], size = "medium", **kwargs):
    native.cc_test(name = name, size = size, tags = _rdma_tags(tags, two_vms), **kwargs)

def rdma_sh_test(name, src, two_vms = False, tags = [], size = "medium", **kwargs):
    """An sh_test of `src` for verbs. The test runs a copy of the script.

    An sh_test's executable is a link to the script in the workspace. The
    VM sees the host's / but has its own /tmp, so a workspace under /tmp (a
    fresh clone there, say) leaves that link dangling in the guest. The copy
    lives in Bazel's output tree beside every test binary the VM runs, and
    begins with tools/rdma_sh_prelude.sh: the checks the scripts share,
    which a sourced file could not be (its runfiles link would dangle too).
    """
    copy = name + "_script.sh"
    prelude = "//tools:rdma_sh_prelude.sh"
    native.genrule(
        name = name + "_script",
        srcs = [prelude, src],
        outs = [copy],
        cmd = "cat $(location %s) $(location %s) > $@" % (prelude, src),
        executable = True,
    )
    native.sh_test(
        name = name,
        size = size,
        srcs = [copy],
        tags = _rdma_tags(tags, two_vms),
        **kwargs
    )
