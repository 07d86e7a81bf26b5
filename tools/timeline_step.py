#!/usr/bin/env python3
"""timeline_step.py — where a decode step's time goes on its critical stream, from a kernel
timeline (DS_CUDA_TIMELINE's CSV, tools/device/timeline48.sh: start_ns, dur_ns, stream, name;
one row a kernel).

Steps are cut at the embedding kernel (the first of every step). For the last STEPS steps (default
4; eager warm-up steps come first, graph replays last) it reports the step's span and, on the
stream the embedding ran on (the main one), what each kernel adds to that stream's end: its
exclusive time end_i - max(end_{i-1}, start_i) (0 when it finished under its predecessor; these
sum to the main stream's span), next to its own duration, summed by kernel name; then the sequence
of one mid-step stretch of kernels (--show N), so that the chain of a layer can be read.

  python3 tools/timeline_step.py TIMELINE.csv [--steps 4] [--show 40]"""
import argparse
import collections
import csv
import re
import sys


def short(name):
    """A mangled kernel name's function name (_Z13moe_grouped_kILi1E... -> moe_grouped_k, its
    template arguments dropped); other names as they are."""
    m = re.match(r"_Z(?:N\d*)?(\d+)", name)
    if not m:
        return name
    n = int(m.group(1))
    return name[m.end():m.end() + n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--show", type=int, default=40)
    a = ap.parse_args()
    rows = []
    with open(a.csv) as f:
        for r in csv.DictReader(f):
            rows.append((int(r["start_ns"]), int(r["dur_ns"]), r["stream"], short(r["name"])))
    if not rows:
        sys.exit("timeline_step: no kernels in %s" % a.csv)
    rows.sort()
    starts = [i for i, r in enumerate(rows) if "embed" in r[3]]
    if len(starts) < 2:
        sys.exit("timeline_step: fewer than two steps (no embedding kernels) in %s" % a.csv)
    starts.append(len(rows))
    steps = [rows[starts[i]:starts[i + 1]] for i in range(len(starts) - 1)]
    # the last step may be followed by other work (the bench's next case): cut each step where
    # its main stream's kernels end
    chosen = steps[-a.steps - 1:-1] if len(steps) > a.steps else steps
    excl = collections.defaultdict(float)
    dur = collections.defaultdict(float)
    cnt = collections.Counter()
    spans, mains, nk = [], [], []
    for st in chosen:
        main = st[0][2]
        ms = [r for r in st if r[2] == main]
        t0 = ms[0][0]
        end = t0
        for s, d, _, name in ms:
            e = s + d
            excl[name] += max(0, e - max(end, s))
            dur[name] += d
            cnt[name] += 1
            end = max(end, e)
        spans.append((end - t0) / 1e3)
        mains.append(len(ms))
        nk.append(len(st))
    n = len(chosen)
    print("steps: %d; span of the main stream %s us; kernels a step: %s (main stream %s)" % (
        n, " ".join("%.1f" % x for x in spans), " ".join(map(str, nk)),
        " ".join(map(str, mains))))
    tot = sum(excl.values()) / n / 1e3
    print("%-44s %6s %10s %10s %7s" % ("kernel (main stream)", "count", "adds us", "runs us",
                                        "share"))
    for name, v in sorted(excl.items(), key=lambda kv: -kv[1]):
        print("%-44s %6.1f %10.1f %10.1f %6.1f%%" % (name[:44], cnt[name] / n, v / n / 1e3,
                                                   dur[name] / n / 1e3, 100 * v / n / 1e3 / tot))
    st = chosen[-1]
    main = st[0][2]
    mid = len(st) // 2
    print("\na stretch of the last step (stream, start us from the step, duration us, adds us):")
    t0 = st[0][0]
    end = None
    for s, d, strm, name in st[mid:mid + a.show]:
        add = ""
        if strm == main:
            add = "%.2f" % (max(0, s + d - max(end if end is not None else s, s)) / 1e3)
            end = max(end or 0, s + d)
        print("  %s %9.2f %8.2f %6s  %s" % ("M" if strm == main else "s", (s - t0) / 1e3, d / 1e3,
                                           add, name[:60]))


if __name__ == "__main__":
    main()
