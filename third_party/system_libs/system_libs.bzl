"""Repository rule exposing the system's C++ libraries as cc_library targets.

pkg-config runs once when the repository is fetched; each library becomes a
cc_library with only linkopts and defines (headers live in /usr/include, a
built-in include directory). Missing packages fail here, naming what to install,
except the optional ones (_OPTIONAL_LIBS: what rdmarpc itself does not need,
so a workspace that uses rdmarpc need not install it): their target then fails
when something builds it, naming the package.
"""

# target name -> (pkg-config modules, extra linkopts, Debian package)
_LIBS = {
    "absl": ([
        "absl_status",
        "absl_statusor",
        "absl_strings",
        "absl_str_format",
        "absl_synchronization",
        "absl_time",
        "absl_flat_hash_map",
        "absl_flags",
        "absl_flags_parse",
        "absl_hash",
    ], [], "libabsl-dev"),
    "gtest": (["gtest"], [], "libgtest-dev"),
    "gtest_main": (["gtest_main"], [], "libgtest-dev"),
    "gmock": (["gmock"], [], "libgtest-dev"),
    "ibverbs": (["libibverbs"], [], "libibverbs-dev"),
    "rdmacm": (["librdmacm"], [], "librdmacm-dev"),
}

_OPTIONAL_LIBS = {
    # bench/grpc_bench: gRPC measured beside rdmarpc.
    "grpc": (["grpc++"], [], "libgrpc++-dev"),
}

def _pkg_config(ctx, flag, modules, package):
    """The flags, or a string saying what failed and what to install."""
    result = ctx.execute(["pkg-config", flag] + modules)
    if result.return_code != 0:
        return "pkg-config %s %s failed: %s\nInstall the Debian package %s (make deps)." % (
            flag,
            " ".join(modules),
            result.stderr.strip(),
            package,
        )
    return [f for f in result.stdout.strip().split(" ") if f]

def _system_libs_impl(ctx):
    lines = ['package(default_visibility = ["//visibility:public"])', ""]
    for name, (modules, extra, package) in _LIBS.items() + _OPTIONAL_LIBS.items():
        libs = _pkg_config(ctx, "--libs", modules, package)
        cflags = _pkg_config(ctx, "--cflags", modules, package)
        missing = [r for r in [libs, cflags] if type(r) == "string"]
        if missing and name not in _OPTIONAL_LIBS:
            fail(missing[0])
        if missing:
            # Fails only what builds it, saying why.
            why = "pkg-config finds no %s: install the Debian package %s (make deps)" % (
                " ".join(modules),
                package,
            )
            lines.append("genrule(")
            lines.append("    name = %r," % (name + "_missing"))
            lines.append("    outs = [%r]," % (name + "_missing.h"))
            lines.append("    cmd = %r," % ("echo '%s' >&2; exit 1" % why))
            lines.append(")")
            lines.append("cc_library(name = %r, hdrs = [%r])" % (name, name + "_missing.h"))
            lines.append("")
            continue
        defines = [f[2:] for f in cflags if f.startswith("-D")]
        lines.append("cc_library(")
        lines.append("    name = %r," % name)
        lines.append("    defines = %r," % defines)
        lines.append("    linkopts = %r," % (libs + extra + ["-lpthread"]))
        lines.append(")")
        lines.append("")
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("BUILD", "\n".join(lines))

system_libs = repository_rule(
    implementation = _system_libs_impl,
    local = True,
    environ = ["PKG_CONFIG_PATH"],
)
