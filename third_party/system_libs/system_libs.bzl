"""Repository rule exposing the system's C++ libraries as cc_library targets.

pkg-config runs once when the repository is fetched; each library becomes a
cc_library with only linkopts and defines (headers live in /usr/include, a
built-in include directory). Missing packages fail here, naming what to install.
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

def _pkg_config(ctx, flag, modules, package):
    result = ctx.execute(["pkg-config", flag] + modules)
    if result.return_code != 0:
        fail("pkg-config %s %s failed: %s\nInstall the Debian package %s (make deps)." %
             (flag, " ".join(modules), result.stderr, package))
    return [f for f in result.stdout.strip().split(" ") if f]

def _system_libs_impl(ctx):
    lines = ['package(default_visibility = ["//visibility:public"])', ""]
    for name, (modules, extra, package) in _LIBS.items():
        libs = _pkg_config(ctx, "--libs", modules, package) + extra
        cflags = _pkg_config(ctx, "--cflags", modules, package)
        defines = [f[2:] for f in cflags if f.startswith("-D")]
        lines.append("cc_library(")
        lines.append("    name = %r," % name)
        lines.append("    defines = %r," % defines)
        lines.append("    linkopts = %r," % (libs + ["-lpthread"]))
        lines.append(")")
        lines.append("")
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("BUILD", "\n".join(lines))

system_libs = repository_rule(
    implementation = _system_libs_impl,
    local = True,
    environ = ["PKG_CONFIG_PATH"],
)
