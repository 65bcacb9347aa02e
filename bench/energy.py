#!/usr/bin/env python3
"""Energy of GPU work from an nvidia-smi log.

Log (one GPU), sampled beside the work:

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw.instant \
        --format=csv,noheader,nounits -lms 100 > power.csv

nvidia-smi has no energy counter field, and power.draw is a 1-second average
on Hopper: the energy is the instant power integrated over the samples
(trapezoids), so keep the sampling interval short against the windows.

Two uses:

    energy.py power.csv --parts sustain.txt
        the lines "sustain <part> <t0> <t1> <calls> <work>" that
        `LOOM_CUDA_OPS_SUSTAIN=S loom_tests cuda_ops_sustain` prints (t0, t1:
        seconds since the epoch, UTC; work in TFLOP or TB): per part the
        energy over [t0, t1] (the counter, interpolated), the mean power,
        the median SM clock, work per second and joules per unit of work.

    energy.py power.csv --busy [--above W] [--from T0 --to T1]
        the span where the board draws more than W watts (default 300; only
        samples between T0 and T1, seconds since the epoch, when given): its
        mean power over the middle 60% of it, and the median
        SM clock there. A training run's joules a step are this power times
        the step's time.
"""
import argparse
import bisect
import datetime
import statistics
import sys


def read_log(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 3:
                continue
            try:
                ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
                ts = ts.replace(tzinfo=datetime.timezone.utc).timestamp()
                rows.append([ts, float(parts[1]), float(parts[2])])
            except ValueError:
                continue  # "[N/A]" or a header: skip the sample
    if len(rows) < 2:
        sys.exit(f"{path}: fewer than two samples of timestamp, clocks.sm, power.draw.instant "
                 "(see the top of this script for the command)")
    rows.sort()
    e = 0.0  # the energy so far (J), a fourth column
    for i, r in enumerate(rows):
        if i:
            e += 0.5 * (r[2] + rows[i - 1][2]) * (r[0] - rows[i - 1][0])
        r.append(e)
    return rows


def energy_at(rows, t):
    """The counter (J) at time t, linear between the samples around it."""
    times = [r[0] for r in rows]
    i = bisect.bisect_left(times, t)
    if i <= 0 or i >= len(rows):
        sys.exit(f"time {t:.3f} lies outside the log ({times[0]:.3f} .. {times[-1]:.3f})")
    (ta, _, _, ea), (tb, _, _, eb) = rows[i - 1], rows[i]
    return ea + (eb - ea) * (t - ta) / (tb - ta) if tb > ta else ea


def window(rows, t0, t1):
    e = energy_at(rows, t1) - energy_at(rows, t0)
    clocks = [r[1] for r in rows if t0 <= r[0] <= t1]
    return e, e / (t1 - t0), statistics.median(clocks) if clocks else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--parts", help="the sustain bench's output")
    ap.add_argument("--busy", action="store_true")
    ap.add_argument("--above", type=float, default=300.0)
    ap.add_argument("--from", dest="t_from", type=float, default=float("-inf"))
    ap.add_argument("--to", dest="t_to", type=float, default=float("inf"))
    a = ap.parse_args()
    try:
        rows = read_log(a.log)
    except OSError as e:
        sys.exit(f"{a.log}: {e.strerror}")
    if a.parts:
        try:
            f = open(a.parts)
        except OSError as e:
            sys.exit(f"{a.parts}: {e.strerror}")
        print("| part | seconds | work / s | mean W | median SM MHz | J per unit of work |")
        print("| --- | --- | --- | --- | --- | --- |")
        with f:
            for line in f:
                w = line.split()
                if len(w) != 6 or w[0] != "sustain":
                    continue
                try:
                    part, t0, t1, work = w[1], float(w[2]), float(w[3]), float(w[5])
                except ValueError:
                    sys.exit(f"{a.parts}: a sustain line whose times or work are not numbers: {line.strip()}")
                if t1 <= t0 or work <= 0:
                    sys.exit(f"{a.parts}: part {part} has no time or no work: {line.strip()}")
                e, p, mhz = window(rows, t0, t1)
                print(f"| {part} | {t1 - t0:.1f} | {work / (t1 - t0):.3f} | {p:.0f} | {mhz:.0f} | {e / work:.3f} |")
    if a.busy:
        busy = [r[0] for r in rows if r[2] > a.above and a.t_from <= r[0] <= a.t_to]
        if len(busy) < 2:
            sys.exit(f"no span above {a.above} W in the log")
        b0, b1 = busy[0], busy[-1]
        if b1 <= b0:
            sys.exit(f"the span above {a.above} W is a single sample: sample more often")
        t0, t1 = b0 + 0.2 * (b1 - b0), b1 - 0.2 * (b1 - b0)
        e, p, mhz = window(rows, t0, t1)
        print(f"busy {b1 - b0:.1f} s above {a.above:.0f} W; middle 60%: {p:.1f} W mean, "
              f"median SM clock {mhz:.0f} MHz, {e:.1f} J")
    if not a.parts and not a.busy:
        ap.error("give --parts FILE or --busy")


if __name__ == "__main__":
    main()
