"""rdmarpc_dependencies: the repositories rdmarpc builds against, for any workspace.

A workspace that uses rdmarpc (WORKSPACE mode; Bazel 4.2.3 is what it is
tested with) declares it and then calls this:

    local_repository(name = "rdmarpc", path = "/path/to/rdmarpc")  # or an http_archive
    load("@rdmarpc//:repositories.bzl", "rdmarpc_dependencies")
    rdmarpc_dependencies()

and takes the flags of README.md ("Using rdmarpc from your own workspace").
Each repository is defined only if the workspace has not defined one of that
name already, so a workspace that brings its own rules_cc or protobuf keeps
it. rdmarpc's own WORKSPACE calls this too. Each is local because the build
runs offline against Debian 12's packages; what each is, is said below.
"""

load("//third_party/system_libs:system_libs.bzl", "system_libs")

def _in_tree_impl(ctx):
    # A directory of this repository as a repository of its own, wherever
    # this repository lies: local_repository would need its path.
    for entry in ctx.path(ctx.attr.marker).dirname.readdir():
        ctx.symlink(entry, entry.basename)

# A repository made of the directory holding `marker`, a file of this
# repository's tree.
_in_tree_repository = repository_rule(
    implementation = _in_tree_impl,
    attrs = {"marker": attr.label(allow_single_file = True)},
    local = True,
)

def _define(rule, name, **kwargs):
    if not native.existing_rule(name):
        rule(name = name, **kwargs)

def rdmarpc_dependencies():
    """Defines rules_cc, rules_java, rules_proto, remote_coverage_tools, com_google_protobuf and system_libs."""

    # Bazel's own WORKSPACE suffix downloads these; same-named local ones win.
    _define(_in_tree_repository, "rules_cc", marker = Label("//third_party/rules_cc:WORKSPACE"))
    _define(native.local_repository, "rules_java", path = "/usr/share/bazel/rules/java")
    _define(native.local_repository, "rules_proto", path = "/usr/share/bazel/rules/proto")
    _define(
        _in_tree_repository,
        "remote_coverage_tools",
        marker = Label("//third_party/remote_coverage_tools:WORKSPACE"),
    )

    # protoc, the well-known-type protos and libprotobuf as installed under /usr.
    _define(
        native.new_local_repository,
        "com_google_protobuf",
        build_file = str(Label("//third_party/protobuf:BUILD.system")),
        path = "/usr",
    )

    # One cc_library per system library, flags from pkg-config.
    _define(system_libs, "system_libs")
