#!/usr/bin/env python3
"""Prints where a round trip's time goes, from a dump of base/stage_trace.h.

    bench/stage_timeline.py FILE.stages...

For each file: how often each thread polled its completion queue (the poll
period bounds how late a thread sees a completion); how long ibv_post_send
took, per thread (the kernel's Soft-RoCE send path runs in that system call,
and the peer can have its message before the call returns); then the round
trips that follow the most common sequence of marks (kRoundTripBegin ..
kRoundTripEnd, polls and post returns left out), with the median and 10th
percentile time from each mark to the next and the thread that took it. The
steps from a post to the peer's poll are the wire (the kernel's part); the
others are user code on one side; the last line sums both.
"""
import collections
import statistics
import sys


def quantile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


def analyze(path):
    names, marks, ticks_per_us, dropped = {}, [], None, 0
    with open(path) as f:
        for line in f:
            w = line.split()
            if w[0] == "stage":
                names[int(w[1])] = (w[2], " ".join(w[3:]))
            elif w[0] == "ticks_per_us":
                ticks_per_us = float(w[1])
            elif w[0] == "dropped":
                dropped = int(w[1])
            else:
                marks.append((int(w[0]), int(w[1]), int(w[2])))
    by_name = {n: i for i, (n, _) in names.items()}
    poll, begin, end = by_name["kPoll"], by_name["kRoundTripBegin"], by_name["kRoundTripEnd"]
    post_begin, post_end = by_name["kPostBegin"], by_name["kPostEnd"]
    polled = by_name["kRecvPolled"]
    us = lambda t: t / ticks_per_us
    print(f"{path}: {len(marks)} marks{f', {dropped} dropped' if dropped else ''}")

    last_poll, periods = {}, collections.defaultdict(list)
    posting, posts = {}, collections.defaultdict(list)
    for stage, t, thread in marks:
        if stage == poll:
            if thread in last_poll:
                periods[thread].append(us(t - last_poll[thread]))
            last_poll[thread] = t
        elif stage == post_begin:
            posting[thread] = t
        elif stage == post_end and thread in posting:
            posts[thread].append(us(t - posting.pop(thread)))
    for thread, p in sorted(periods.items()):
        if len(p) >= 100:
            print(f"  thread {thread} polled {len(p)} times, every {statistics.median(p):.2f} us "
                  f"(median; p90 {quantile(p, 0.9):.2f})")
    for thread, p in sorted(posts.items()):
        if len(p) >= 100:
            print(f"  thread {thread}: ibv_post_send took {statistics.median(p):.2f} us "
                  f"(median of {len(p)}; p10 {quantile(p, 0.1):.2f})")

    trips, current = [], None
    for stage, t, thread in marks:
        if stage in (poll, post_end):
            continue
        if stage == begin:
            current = [(stage, t, thread)]
        elif current is not None:
            current.append((stage, t, thread))
            if stage == end:
                trips.append(current)
                current = None
    if not trips:
        print("  no complete round trip recorded")
        return
    patterns = collections.Counter(tuple(m[0] for m in trip) for trip in trips)
    pattern, count = patterns.most_common(1)[0]
    regular = [trip for trip in trips if tuple(m[0] for m in trip) == pattern]
    total = [us(trip[-1][1] - trip[0][1]) for trip in regular]
    print(f"  {count} of {len(trips)} round trips in the usual sequence; their median "
          f"{statistics.median(total):.2f} us")
    sums = {"from a post to the peer's poll": 0.0, "user code": 0.0}
    for i in range(len(pattern) - 1):
        d = [us(trip[i + 1][1] - trip[i][1]) for trip in regular]
        median = statistics.median(d)
        a, b = pattern[i], pattern[i + 1]
        thread = regular[0][i + 1][2]
        kind = "from a post to the peer's poll" if (a, b) == (post_begin, polled) else "user code"
        sums[kind] += median
        print(f"  {median:7.2f} us (p10 {quantile(d, 0.1):6.2f})  thread {thread}: "
              f"{names[a][1]} -> {names[b][1]}")
    print("  sums of medians: " + ", ".join(f"{k} {v:.2f} us" for k, v in sums.items()))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        analyze(p)
