#!/usr/bin/env python3
"""Per small call: instructions by function (self) and calls by callee.

    callgrind_per_call.py CALLS_SHORT CALLS_LONG PINGS_SHORT PINGS_LONG EXTRA [TOP]

Reads four callgrind profiles of bench/rpc_bench made by
bench/call_profile.sh: with small calls (CALLS_*) and without (PINGS_*),
each at a short and a long run that differ by EXTRA round trips. What a
small call costs is (CALLS_LONG - CALLS_SHORT) - (PINGS_LONG - PINGS_SHORT),
divided by EXTRA: start-up, teardown and the transport's own ping-pong
(which both runs make) cancel out.

Why calls as well as instructions: the costs that hide are small
functions called more often than the code suggests (a std::string move is
a memcpy call, a by-value parameter a move and a destruction). Under the
emulator each call and return also costs a lookup of the next translated
block, beyond its instructions.

The pollers' spinning shows up too (their poll loop, the provider's poll,
clock reads) and grows with how long a call takes under callgrind, which
is not what it takes in a real run; those functions are left out (SPIN).
"""
import collections
import re
import sys

SPIN = re.compile(r"PollLoop|PollOnce|IdleSpin|DrivenRecently|TryOwnIo|ReleaseIo|"
                  r"Endpoint::Drive|steady_clock|clock_gettime|pthread_self|"
                  r"pthread_spin|sched_yield|introsort|__sort|0x0000000000002ca0 in librxe")

SHORTEN = [
    ("std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >", "string"),
    ("absl::debian3::", "absl::"),
    ("rdmarpc::transport::", "rt::"),
    ("rdmarpc::", ""),
    ("google::protobuf::", "pb::"),
]

NAMED = re.compile(r"^\((\d+)\)(?: (.*))?$")


def load(path):
    """Self Ir per function and call counts per callee, from a callgrind file."""
    names = {}  # callgrind's name compression: "(id) name" once, "(id)" after
    objects = {}
    self_ir = collections.Counter()
    calls = collections.Counter()
    fn = callee = None
    ob = cob = ""
    after_calls = False

    def name_of(spec, table):
        m = NAMED.match(spec)
        if not m:
            return spec
        if m.group(2):
            table[m.group(1)] = m.group(2)
        return table.get(m.group(1), m.group(1))

    def qualified(name, obj):
        # Functions without a symbol are known by address, which repeats
        # across libraries: name the library.
        return name + " in " + obj.rsplit("/", 1)[-1] if name.startswith("0x") else name

    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("ob="):
                ob = cob = name_of(line[3:].strip(), objects)
            elif line.startswith("cob="):
                cob = name_of(line[4:].strip(), objects)
            elif line.startswith("fn="):
                fn = qualified(name_of(line[3:].strip(), names), ob)
                cob = ob
            elif line.startswith("cfn="):
                callee = qualified(name_of(line[4:].strip(), names), cob)
            elif line.startswith("calls="):
                calls[callee] += int(line[6:].split()[0])
                after_calls = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                fields = line.split()
                if after_calls:  # the inclusive cost of that call, not self
                    after_calls = False
                elif len(fields) > 1:
                    self_ir[fn] += int(fields[1])
    return self_ir, calls


def per_call(runs, extra):
    (r1, r2, t1, t2) = runs
    keys = set(r1) | set(r2) | set(t1) | set(t2)
    return {k: ((r2[k] - r1[k]) - (t2[k] - t1[k])) / extra for k in keys}


def short(name):
    for a, b in SHORTEN:
        name = name.replace(a, b)
    return name[:140]


def main():
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    paths, extra = sys.argv[1:5], int(sys.argv[5])
    top = int(sys.argv[6]) if len(sys.argv) > 6 else 40
    loaded = [load(p) for p in paths]
    self_ir = per_call([l[0] for l in loaded], extra)
    calls = per_call([l[1] for l in loaded], extra)
    kept = {k: v for k, v in self_ir.items() if k and not SPIN.search(k)}
    print("per small call, spinning left out: %.0f instructions (self, all functions)"
          % sum(kept.values()))
    print("\ninstructions (self) by function, per small call:")
    for name, v in sorted(kept.items(), key=lambda kv: -kv[1])[:top]:
        print("%8.1f  %s" % (v, short(name)))
    print("\ncalls by callee, per small call:")
    kept = {k: v for k, v in calls.items() if k and not SPIN.search(k) and v >= 0.5}
    for name, v in sorted(kept.items(), key=lambda kv: -kv[1])[:top]:
        print("%8.2f  %s" % (v, short(name)))


if __name__ == "__main__":
    main()
