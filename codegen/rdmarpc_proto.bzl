"""rdmarpc_cc_proto_library: protobuf's C++ code plus rdmarpc's stubs and services.

    load("//codegen:rdmarpc_proto.bzl", "rdmarpc_cc_proto_library")
    # from another workspace: load("@rdmarpc//codegen:rdmarpc_proto.bzl", ...)

    proto_library(name = "echo_proto", srcs = ["echo.proto"])
    rdmarpc_cc_proto_library(name = "echo_rdmarpc", deps = [":echo_proto"])
    # cc code: #include "path/to/echo.rdmarpc.pb.h"

The result is one cc_library holding protobuf's generated code for the
proto_library (via cc_proto_library, so imports and well-known types work as
usual) and protoc-gen-rdmarpc's for its services. The plugin is an input of the
generating action: editing it regenerates and recompiles every user.
The proto_library must live in the same package and must not use
import_prefix or strip_import_prefix (generated paths follow the package).
"""

def _gen_impl(ctx):
    proto = ctx.attr.proto[ProtoInfo]
    srcs = proto.direct_sources
    hdrs = []
    ccs = []
    for src in srcs:
        if src.short_path.startswith("../") or src.dirname.find("_virtual_imports") >= 0:
            fail("%s: %s uses import_prefix/strip_import_prefix or lives in another repository; " %
                 (ctx.label, src.short_path) + "rdmarpc_cc_proto_library needs a plain proto_library")
        if src.owner.package != ctx.label.package:
            fail("%s: proto_library %s must be in package %s" %
                 (ctx.label, ctx.attr.proto.label, ctx.label.package))
        base = src.basename[:-len(".proto")]
        hdrs.append(ctx.actions.declare_file(base + ".rdmarpc.pb.h"))
        ccs.append(ctx.actions.declare_file(base + ".rdmarpc.pb.cc"))

    out_root = ctx.bin_dir.path
    if ctx.label.workspace_root:
        out_root += "/" + ctx.label.workspace_root
    args = ctx.actions.args()
    args.add("--plugin=protoc-gen-rdmarpc=" + ctx.executable._plugin.path)
    args.add("--rdmarpc_out=" + out_root)
    args.add_joined(
        "--descriptor_set_in",
        proto.transitive_descriptor_sets,
        join_with = ":",
    )
    args.add_all([src.short_path for src in srcs])
    ctx.actions.run(
        executable = ctx.executable._protoc,
        arguments = [args],
        inputs = proto.transitive_descriptor_sets,
        tools = [ctx.executable._plugin],
        outputs = hdrs + ccs,
        mnemonic = "RdmarpcGen",
        progress_message = "Generating rdmarpc stubs for %s" % ctx.attr.proto.label,
    )
    return [
        DefaultInfo(files = depset(hdrs + ccs)),
        OutputGroupInfo(headers = depset(hdrs), sources = depset(ccs)),
    ]

_rdmarpc_gen = rule(
    implementation = _gen_impl,
    attrs = {
        "proto": attr.label(mandatory = True, providers = [ProtoInfo]),
        "_protoc": attr.label(
            default = "@com_google_protobuf//:bin/protoc",
            executable = True,
            allow_single_file = True,
            cfg = "exec",
        ),
        "_plugin": attr.label(
            default = Label("//codegen:protoc-gen-rdmarpc"),
            executable = True,
            cfg = "exec",
        ),
    },
)

def rdmarpc_cc_proto_library(name, deps, copts = [], visibility = None, testonly = False, **kwargs):
    """One cc_library with protobuf's and rdmarpc's generated code.

    Args:
      name: the cc_library's name.
      deps: exactly one proto_library in the same package.
      copts: extra compiler flags for the generated rdmarpc code.
      visibility: as usual.
      testonly: as usual.
      **kwargs: passed to the cc_library.
    """
    if len(deps) != 1:
        fail("rdmarpc_cc_proto_library %s: deps must hold exactly one proto_library" % name)
    native.cc_proto_library(
        name = name + "_pb",
        deps = deps,
        visibility = visibility,
        testonly = testonly,
    )
    _rdmarpc_gen(name = name + "_gen", proto = deps[0], testonly = testonly)
    native.filegroup(
        name = name + "_gen_hdrs",
        srcs = [":" + name + "_gen"],
        output_group = "headers",
        testonly = testonly,
    )
    native.filegroup(
        name = name + "_gen_srcs",
        srcs = [":" + name + "_gen"],
        output_group = "sources",
        testonly = testonly,
    )
    native.cc_library(
        name = name,
        hdrs = [":" + name + "_gen_hdrs"],
        srcs = [":" + name + "_gen_srcs"],
        copts = copts,
        # Label(): rdmarpc's //rpc also when this is loaded from another workspace.
        deps = [":" + name + "_pb", Label("//rpc")],
        visibility = visibility,
        testonly = testonly,
        **kwargs
    )
