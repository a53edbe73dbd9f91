"""Line coverage of the project's code from gcov counts (tools/coverage.sh).

  python3 tools/coverage_report.py EXECROOT UNCOVERED_TXT

Runs gcov (JSON) on every object of rpc/, transport/, codegen/ and base/
under EXECROOT's bazel-out, merges the counts of each source line over every
object that compiled it (a header's inline code is in many), prints one line
per source file and writes the lines no test ran, with their text, to
UNCOVERED_TXT. Test sources are left out.
"""
import collections
import json
import os
import subprocess
import sys

DIRS = ("rpc/", "transport/", "codegen/", "base/")


def is_ours(path):
    return (path.startswith(DIRS) and not path.endswith("_test.cc") and
            "/testing/" not in path and "/bench/" not in path)


def main():
    execroot, uncovered_path = sys.argv[1], sys.argv[2]
    objs = os.path.join(execroot, "bazel-out")
    notes = []
    for root, _, files in os.walk(objs):
        if "/_objs/" not in root + "/":
            continue
        notes += [os.path.join(root, f) for f in files if f.endswith(".gcno")]
    counts = collections.defaultdict(dict)  # source -> line -> count
    for gcno in notes:
        gcda = gcno[: -len(".gcno")] + ".gcda"
        if not os.path.exists(gcda):  # linked into no test that ran: all zero
            gcda = gcno
        result = subprocess.run(
            ["gcov", "--json-format", "--stdout", "-o", os.path.dirname(gcno), gcda],
            cwd=execroot, capture_output=True)
        for doc in result.stdout.splitlines():
            if not doc.strip():
                continue
            for f in json.loads(doc).get("files", []):
                source = os.path.normpath(f["file"])
                if not is_ours(source):
                    continue
                lines = counts[source]
                for line in f["lines"]:
                    n = line["line_number"]
                    lines[n] = max(lines.get(n, 0), line["count"])
    total_lines = total_run = 0
    with open(uncovered_path, "w") as out:
        for source in sorted(counts):
            lines = counts[source]
            if not lines:  # declarations only
                continue
            run = sum(1 for c in lines.values() if c > 0)
            total_lines += len(lines)
            total_run += run
            print(f"{100.0 * run / len(lines):5.1f}%  {run:5d}/{len(lines):<5d}  {source}")
            missed = sorted(n for n, c in lines.items() if c == 0)
            if not missed:
                continue
            text = open(os.path.join(execroot, source), errors="replace").read().splitlines()
            out.write(f"== {source}: {len(missed)} lines no test ran\n")
            for n in missed:
                out.write(f"{n:6d}  {text[n - 1] if n <= len(text) else ''}\n")
    print(f"{100.0 * total_run / max(total_lines, 1):5.1f}%  {total_run:5d}/{total_lines:<5d}  "
          f"all; lines no test ran: {uncovered_path}")


if __name__ == "__main__":
    main()
