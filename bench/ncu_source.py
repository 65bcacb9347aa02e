#!/usr/bin/env python3
"""Where one kernel's instructions and stalls are, from Nsight Compute's
per-instruction source page (bench/ncu_source.sh makes it):

  ncu -i REPORT --page source --csv --print-source sass > FILE.csv
  python3 bench/ncu_source.py FILE.csv [--window N] [--top K]
  python3 bench/ncu_source.py --self-test

Prints the instructions executed (warp-level) and the share of each opcode
(its base name: IMAD.WIDE counts as IMAD) with its stall samples; the warps'
stall reasons over all samples; then the kernel's SASS in windows of N
instructions (default 100) that hold at least 1% of the samples, each with
its three largest stall reasons and its commonest opcodes, so a hot loop or
a staging sequence shows where it sits. Integer opcodes (IMAD, ISETP, LEA,
IADD3, LOP3, SHF, SEL) far above the tensor cores' HMMA are address and
bounds arithmetic: what made chunk_bwd_tc's first version slow (bench/
RESULTS.md, Qwen3.5's seventh round).

Exits 2 on bad arguments or a file that is not such a page, 1 when
--self-test fails.
"""
import argparse
import collections
import csv
import io
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


class PageError(Exception):
    pass


def num(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass):
    """The instruction's base opcode: its first word after a predicate."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def read_page(text):
    """(kernel name, rows of (sass, executed, samples, {stall: samples}))."""
    try:
        lines = list(csv.reader(io.StringIO(text)))
    except csv.Error as e:
        raise PageError(f"not CSV ({e})") from e
    if len(lines) < 3 or not lines[0] or lines[0][0] != "Kernel Name":
        raise PageError("not an ncu source page: it starts with a \"Kernel Name\" line "
                        "(ncu -i REPORT --page source --csv --print-source sass)")
    head = lines[1]
    col = {h: i for i, h in enumerate(head)}
    for need in ("Source", SAMPLES, EXECUTED):
        if need not in col:
            raise PageError(f"no \"{need}\" column: give the page of a report with "
                            "--section SourceCounters and --section WarpStateStats")
    stalls = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
    rows = []
    for r in lines[2:]:
        if len(r) != len(head):
            continue  # a later kernel's header, or the tail
        rows.append((r[col["Source"]], num(r[col[EXECUTED]]), num(r[col[SAMPLES]]),
                     {s[6:]: num(r[col[s]]) for s in stalls}))
    if not rows:
        raise PageError("the page lists no instructions")
    return (lines[0][1] if len(lines[0]) > 1 else "?"), rows


def summary(name, rows, window, top):
    out = []
    executed = sum(r[1] for r in rows)
    samples = sum(r[2] for r in rows) or 1.0
    out.append(f"kernel: {name}")
    out.append(f"{len(rows)} instructions in the code, {executed:,.0f} executed (warps), "
               f"{samples:,.0f} stall samples")
    ops = collections.Counter()
    op_samples = collections.Counter()
    stall = collections.Counter()
    for sass, ex, sm, st in rows:
        ops[opcode(sass)] += ex
        op_samples[opcode(sass)] += sm
        stall.update(st)
    out.append("opcode share of executed instructions (stall samples):")
    for op, ex in ops.most_common(top):
        out.append(f"  {op:10s} {100 * ex / (executed or 1):5.1f}%  ({op_samples[op]:,.0f})")
    out.append("stall reasons: " + ", ".join(
        f"{k} {100 * v / samples:.1f}%" for k, v in stall.most_common(8) if v > 0))
    out.append(f"windows of {window} instructions with 1% of the samples or more:")
    for w0 in range(0, len(rows), window):
        seg = rows[w0:w0 + window]
        s = sum(r[2] for r in seg)
        if s < 0.01 * samples:
            continue
        st = collections.Counter()
        seg_ops = collections.Counter()
        for sass, _, _, stv in seg:
            st.update(stv)
            seg_ops[opcode(sass)] += 1
        reasons = ", ".join(f"{k} {100 * v / samples:.1f}%" for k, v in st.most_common(3))
        common = " ".join(f"{k}x{v}" for k, v in seg_ops.most_common(5))
        out.append(f"  {w0:6d}  {100 * s / samples:5.1f}%  [{reasons}]  {common}")
    return "\n".join(out)


SAMPLE = """\
"Kernel Name","k(int)",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0","IMAD R1, R2, R3, RZ","10","100","2","8","2"
"1","@!P0 IMAD.WIDE R4, R1, 0x4, R6","30","100","20","10","20"
"2","LDG.E R5, desc[UR4][R4.64]","40","100","40","0","40"
"3","HMMA.16816.F32.BF16 R8, R12, R14, R8","20","100","0","20","0"
"Kernel Name","other(int)",
"""


def self_test():
    name, rows = read_page(SAMPLE)
    text = summary(name, rows, 2, 5)
    want = ["kernel: k(int)", "4 instructions in the code, 400 executed (warps), 100 stall",
            "  IMAD        50.0%  (40)", "  LDG         25.0%  (40)", "  HMMA        25.0%  (20)",
            "stall reasons: long_sb 62.0%, wait 38.0%",
            "       0   40.0%  [long_sb 22.0%, wait 18.0%]  IMADx2",
            "       2   60.0%  [long_sb 40.0%, wait 20.0%]  LDGx1 HMMAx1"]
    bad = [w for w in want if w not in text]
    try:
        read_page("a,b\n")
        bad.append("a page without a Kernel Name line was read")
    except PageError:
        pass
    try:
        read_page('"Kernel Name","k",\n"Address","Source"\n"0","NOP"\n')
        bad.append("a page without the sampling columns was read")
    except PageError:
        pass
    if bad:
        print("ncu_source.py self-test: missing or wrong:\n" + "\n".join(bad) + "\n--\n" + text,
              file=sys.stderr)
        return 1
    print(f"ncu_source.py self-test: {len(want) + 2} checks passed")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="?")
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.csv:
        ap.error("give the CSV of ncu's source page (or --self-test)")
    if a.window < 1 or a.top < 1:
        ap.error("--window and --top are counts of 1 or more")
    try:
        with open(a.csv, encoding="utf-8", errors="replace") as f:
            name, rows = read_page(f.read())
    except OSError as e:
        print(f"ncu_source.py: {a.csv}: {e.strerror}", file=sys.stderr)
        return 2
    except PageError as e:
        print(f"ncu_source.py: {a.csv}: {e}", file=sys.stderr)
        return 2
    print(summary(name, rows, a.window, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
