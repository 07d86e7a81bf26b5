#!/usr/bin/env python3
"""timeline_step.py — where a decode step's time goes, from a kernel timeline (DS_CUDA_TIMELINE's
CSV, tools/device/timeline48.sh: start_ns, dur_ns, stream, name; one row a kernel).

Steps are cut at the embedding kernel (the first of every step); the last STEPS complete steps
(default 4: graph replays, after the eager warm-up) are read. A graph's kernels run on streams
of the graph's own, so streams say nothing here: the step's time is cut into the stretches
between kernel starts and ends, and each stretch goes to the kernels running in it — whole to a
kernel running alone, split evenly where several overlap, to "idle" where none runs. Per kernel
name: launches a step, its own duration, the time it ran alone and its share; then the step's
span, idle time and the host's gap to the next step, and a stretch of one step in order. Kernels
matching --background (default: the L2 prefetches, which run beside the chain on a stream of
their own) are listed but take no share, so that "alone" is the time a kernel of the chain held
the GPU by itself.

  python3 tools/timeline_step.py TIMELINE.csv [--steps 4] [--show 40] [--background REGEX]"""
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


def attribute(step, background):
    """{name: [alone ns, shared ns]} and idle ns over the step's span; kernels whose name matches
    background take no share (and leave the time to the others, or idle)."""
    ev = []
    for i, (s, d, _, name) in enumerate(step):
        if background and re.search(background, name):
            continue
        ev.append((s, 1, i))
        ev.append((s + d, -1, i))
    ev.sort()
    running, out, idle = set(), collections.defaultdict(lambda: [0.0, 0.0]), 0.0
    last = ev[0][0]
    for t, kind, i in ev:
        dt = t - last
        if dt > 0:
            if not running:
                idle += dt
            elif len(running) == 1:
                out[step[next(iter(running))][3]][0] += dt
            else:
                for j in running:
                    out[step[j][3]][1] += dt / len(running)
        last = t
        if kind > 0:
            running.add(i)
        else:
            running.discard(i)
    return out, idle


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--show", type=int, default=40)
    ap.add_argument("--background", default="l2_prefetch")
    a = ap.parse_args()
    rows = []
    with open(a.csv) as f:
        for r in csv.DictReader(f):
            rows.append((int(r["start_ns"]), int(r["dur_ns"]), r["stream"], short(r["name"])))
    rows.sort()
    starts = [i for i, r in enumerate(rows) if r[3] == "embed_k"]
    if len(starts) < 3:
        sys.exit("timeline_step: fewer than two whole steps (embedding kernels) in %s" % a.csv)
    steps = [(rows[starts[i]:starts[i + 1]], rows[starts[i + 1]][0])
             for i in range(len(starts) - 1)]
    chosen = steps[-a.steps:]
    n = len(chosen)
    tot = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])  # alone, shared, own, count
    spans, idles, gaps, nk = [], [], [], []
    for st, next_start in chosen:
        t0, t1 = st[0][0], max(s + d for s, d, _, _ in st)
        att, idle = attribute(st, a.background)
        for name, (al, sh) in att.items():
            tot[name][0] += al
            tot[name][1] += sh
        for s, d, _, name in st:
            tot[name][2] += d
            tot[name][3] += 1
        spans.append((t1 - t0) / 1e3)
        idles.append(idle / 1e3)
        gaps.append((next_start - t1) / 1e3)
        nk.append(len(st))
    mean = lambda xs: sum(xs) / len(xs)
    print("steps: %d; kernels a step %d; span %.1f us (idle inside %.1f us); the gap to the next "
          "step's first kernel %.1f us; step to step %.1f us" % (
              n, nk[-1], mean(spans), mean(idles), mean(gaps), mean(spans) + mean(gaps)))
    span = mean(spans)
    print("%-34s %6s %9s %9s %9s %7s" % ("kernel", "count", "own us", "alone us", "shared us",
                                        "share"))
    for name, (al, sh, own, c) in sorted(tot.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
        print("%-34s %6.1f %9.1f %9.1f %9.1f %6.1f%%" % (name[:34], c / n, own / n / 1e3,
                                                      al / n / 1e3, sh / n / 1e3,
                                                      100 * (al + sh) / n / 1e3 / span))
    st = chosen[-1][0]
    t0 = st[0][0]
    mid = len(st) // 2
    print("\na stretch of the last step (start us from the step, duration us, stream):")
    for s, d, strm, name in st[mid:mid + a.show]:
        print("  %9.2f %8.2f %4s  %s" % ((s - t0) / 1e3, d / 1e3, strm, name[:60]))


if __name__ == "__main__":
    main()
