#!/usr/bin/env python3
"""Generates src/data/unicode_tables.{c,h}: the Unicode data of loom's tokenizer.

    python3 tools/gen_unicode.py            (writes the two files)
    python3 tools/gen_unicode.py --check    (fails when the committed files differ)

The generated files are committed: the build never runs this script.

What the tables are for, and which Unicode version each must have to reproduce
Hugging Face `tokenizers` (0.2x, the Python wheels) exactly:

* General categories L* (letters), N* (numbers) and M* (marks: Mn, Mc, Me;
  only Qwen3.5's regex names them) and the White_Space property: the
  pre-tokenizer regexes (`\\p{L}`, `\\p{N}`, `\\p{M}`, `\\s`) run in
  Oniguruma 6.9.10 (onig_sys 69.9), whose tables are Unicode 16.0.0. Python's
  own `unicodedata` may be older (3.11 has 14.0.0): this script takes
  `unicodedata2` when it is installed (`pip install unicodedata2==16.0.0`) and
  refuses a version other than CATEGORY_VERSION unless --any-version is given.
  White_Space is derived as Zs + Zl + Zp + U+0009..U+000D + U+0085 (that is
  PropList's White_Space in every version since 6.3; Python's str.isspace also
  takes U+001C..U+001F, which White_Space and the regex `\\s` do not).
* NFC (canonical combining classes, full canonical decompositions, primary
  composites, and the set of code points that NFC can change or that can
  combine with a neighbour): `tokenizers` normalizes with the crate
  unicode-normalization-alignments 0.1.12, whose tables are Unicode 9.0.0.
  Normalization data of an assigned character never changes (Unicode's
  stability policy), so the 9.0 tables are the newer data restricted to the
  code points assigned in 9.0; a later character is, for that crate, a
  starter with no decomposition that composes with nothing. The Age property
  is not in Python's unicodedata: it comes from Perl's Unicode::UCD
  (prop_invlist("Present_In=9.0")). The result is checked against the sizes
  of the crate's tables (814 non-zero classes, 2060 decompositions, 940
  composition pairs of which 12 astral).

The case-insensitive group of the Qwen/Llama-3 regex, (?i:'s|'t|'re|'ve|'m|'ll|'d),
is matched in C by hand; the script asserts that the only non-ASCII character
whose case folding is one of those letters is U+017F (long s, folds to 's').
"""

import argparse
import bisect
import os
import subprocess
import sys

CATEGORY_VERSION = "16.0.0"
NFC_VERSION = "9.0"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_C = os.path.join(ROOT, "src", "data", "unicode_tables.c")
OUT_H = os.path.join(ROOT, "src", "data", "unicode_tables.h")

S_BASE, L_BASE, V_BASE, T_BASE = 0xAC00, 0x1100, 0x1161, 0x11A7
L_COUNT, V_COUNT, T_COUNT = 19, 21, 28
N_COUNT = V_COUNT * T_COUNT
S_COUNT = L_COUNT * N_COUNT

CLS_L, CLS_N, CLS_WS, CLS_M = 1, 2, 3, 4


def load_ucd(any_version):
    try:
        import unicodedata2 as ud
        name = "unicodedata2 %s" % ud.unidata_version
    except ImportError:
        import unicodedata as ud
        name = "Python %d.%d unicodedata" % sys.version_info[:2]
    if ud.unidata_version != CATEGORY_VERSION and not any_version:
        sys.exit("gen_unicode.py: %s has Unicode %s, the categories must be %s (Oniguruma 6.9.10 in "
                 "Hugging Face tokenizers): pip install unicodedata2==%s, or pass --any-version"
                 % (name, ud.unidata_version, CATEGORY_VERSION, CATEGORY_VERSION))
    return ud, name


def present_in(version):
    """Inversion list of the code points assigned in Unicode `version` or before (Perl's UCD)."""
    try:
        out = subprocess.check_output(
            ["perl", "-MUnicode::UCD=prop_invlist", "-e",
             'print Unicode::UCD::UnicodeVersion(), "\\n", join(",", prop_invlist("Present_In=%s"))' % version])
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit("gen_unicode.py: Perl's Unicode::UCD is needed for the Age property (%s)" % e)
    lines = out.decode().split("\n")
    inv = [int(x) for x in lines[1].split(",")]
    if not inv:
        sys.exit("gen_unicode.py: Perl knows no code points present in Unicode %s" % version)
    return lines[0], inv


def ranges_of(pred, lo=0, hi=0x110000):
    """[(first, last)] runs of code points where pred holds."""
    out, start = [], None
    for c in range(lo, hi):
        if pred(c):
            if start is None:
                start = c
        elif start is not None:
            out.append((start, c - 1))
            start = None
    if start is not None:
        out.append((start, hi - 1))
    return out


def valued_ranges(values, hi=0x110000):
    """[(first, last, v)] runs of equal non-zero value; values: dict cp -> v."""
    out = []
    for c in sorted(values):
        v = values[c]
        if out and out[-1][1] == c - 1 and out[-1][2] == v:
            out[-1] = (out[-1][0], c, v)
        else:
            out.append((c, c, v))
    return out


class NFC9:
    """The algorithm of unicode-normalization-alignments (decompose, stable sort of
    non-starter runs by class, then the composee / last-class recomposition)."""

    def __init__(self, ccc, decomp, comp):
        self.ccc, self.decomp, self.comp = ccc, decomp, comp

    def decompose(self, c):
        if S_BASE <= c < S_BASE + S_COUNT:
            s = c - S_BASE
            out = [L_BASE + s // N_COUNT, V_BASE + (s % N_COUNT) // T_COUNT]
            if s % T_COUNT:
                out.append(T_BASE + s % T_COUNT)
            return out
        return self.decomp.get(c, [c])

    def compose(self, a, b):
        if L_BASE <= a < L_BASE + L_COUNT and V_BASE <= b < V_BASE + V_COUNT:
            return S_BASE + ((a - L_BASE) * V_COUNT + (b - V_BASE)) * T_COUNT
        if S_BASE <= a < S_BASE + S_COUNT and T_BASE < b < T_BASE + T_COUNT and (a - S_BASE) % T_COUNT == 0:
            return a + (b - T_BASE)
        return self.comp.get((a, b))

    def nfd(self, cps):
        out, run = [], []
        for c in cps:
            for d in self.decompose(c):
                if self.ccc.get(d, 0) == 0:
                    run.sort(key=lambda x: self.ccc.get(x, 0))
                    out += run
                    run = []
                    out.append(d)
                else:
                    run.append(d)
        run.sort(key=lambda x: self.ccc.get(x, 0))
        return out + run

    def nfc(self, cps):
        out, buf, composee, last = [], [], None, None
        for ch in self.nfd(cps):
            cls = self.ccc.get(ch, 0)
            if composee is None:
                if cls != 0:
                    out.append(ch)
                else:
                    composee = ch
                continue
            if last is None:
                r = self.compose(composee, ch)
                if r is not None:
                    composee = r
                    continue
                if cls == 0:
                    out.append(composee)
                    composee = ch
                    continue
                buf.append(ch)
                last = cls
            elif last >= cls:
                if cls == 0:
                    out.append(composee)
                    out += buf
                    buf, composee, last = [], ch, None
                    continue
                buf.append(ch)
                last = cls
            else:
                r = self.compose(composee, ch)
                if r is not None:
                    composee = r
                    continue
                buf.append(ch)
                last = cls
        if composee is not None:
            out.append(composee)
        return out + buf


def build(any_version):
    ud, ud_name = load_ucd(any_version)
    perl_ucd, inv9 = present_in(NFC_VERSION)

    def in9(c):
        return bisect.bisect_right(inv9, c) % 2 == 1

    # ---- categories
    def cls_of(c):
        ch = chr(c)
        cat = ud.category(ch)
        if cat[0] == "L":
            return CLS_L
        if cat[0] == "N":
            return CLS_N
        if cat[0] == "M":
            return CLS_M
        if cat in ("Zs", "Zl", "Zp") or 0x09 <= c <= 0x0D or c == 0x85:
            return CLS_WS
        return 0

    classes = {}
    for c in range(0x110000):
        if 0xD800 <= c <= 0xDFFF:
            continue
        v = cls_of(c)
        if v:
            classes[c] = v
    ws = sorted(c for c, v in classes.items() if v == CLS_WS)
    # White_Space is str.isspace without the four information separators
    iss = sorted(c for c in range(0x110000) if chr(c).isspace() and not 0x1C <= c <= 0x1F)
    assert ws == iss, (ws, iss)
    assert ws == [9, 10, 11, 12, 13, 0x20, 0x85, 0xA0, 0x1680] + list(range(0x2000, 0x200B)) + \
        [0x2028, 0x2029, 0x202F, 0x205F, 0x3000], ws
    # no mark is White_Space or below U+0300 (the ASCII table has no marks)
    assert min(c for c, v in classes.items() if v == CLS_M) == 0x300
    class_ranges = valued_ranges(classes)
    ascii_class = [classes.get(c, 0) for c in range(128)]

    # ---- the case-insensitive letters of the Qwen / Llama-3 contractions
    for x in "strevmld":
        folds = [c for c in range(0x80, 0x110000)
                 if not 0xD800 <= c <= 0xDFFF and (chr(c).casefold() == x or chr(c).lower() == x)]
        assert folds == ([0x17F] if x == "s" else []), (x, folds)
    for c in range(0x80, 0x110000):
        if not 0xD800 <= c <= 0xDFFF:
            assert chr(c).casefold() not in ("re", "ve", "ll"), hex(c)

    # ---- normalization data of the Unicode 9.0 repertoire
    ccc = {}
    decomp1 = {}
    for c in range(0x110000):
        if not in9(c) or 0xD800 <= c <= 0xDFFF:
            continue
        ch = chr(c)
        k = ud.combining(ch)
        if k:
            ccc[c] = k
        if S_BASE <= c < S_BASE + S_COUNT:
            continue
        d = ud.decomposition(ch)
        if d and not d.startswith("<"):
            decomp1[c] = [int(x, 16) for x in d.split()]
    for c, d in decomp1.items():
        assert all(in9(x) for x in d), hex(c)
    # full canonical decompositions
    def full(c):
        if c not in decomp1:
            return [c]
        out = []
        for x in decomp1[c]:
            out += full(x)
        return out
    decomp = {c: full(c) for c in decomp1}
    for c, d in decomp.items():
        assert "".join(map(chr, d)) == ud.normalize("NFD", chr(c)), hex(c)
    # primary composites: a pair decomposition that NFC recomposes
    comp = {}
    for c, d in decomp1.items():
        if len(d) == 2 and ud.normalize("NFC", ud.normalize("NFD", chr(c))) == chr(c):
            assert ccc.get(d[0], 0) == 0, hex(c)
            comp[(d[0], d[1])] = c
    n_astral = sum(1 for (a, b) in comp if a > 0xFFFF or b > 0xFFFF)
    sizes = (len(ccc), len(decomp), len(comp), n_astral)
    if sizes != (814, 2060, 940, 12):
        sys.exit("gen_unicode.py: Unicode %s tables have %r non-zero classes / decompositions / "
                 "composition pairs / astral pairs; unicode-normalization-alignments 0.1.12 has "
                 "(814, 2060, 940, 12)" % (NFC_VERSION, sizes))
    model = NFC9(ccc, decomp, comp)

    # every assigned 9.0 code point alone: the model is Python's NFC; later ones are inert
    for c in range(0x110000):
        if 0xD800 <= c <= 0xDFFF:
            continue
        got = model.nfc([c])
        if in9(c):
            assert "".join(map(chr, got)) == ud.normalize("NFC", chr(c)), hex(c)
        else:
            assert got == [c], hex(c)

    # "unsafe": NFC may change a string at such a code point, or join it to what
    # precedes. Everything else is a boundary: NFC(x + y) = NFC(x) + NFC(y) when
    # y starts with a safe code point.
    seconds = {b for (_a, b) in comp} | set(range(V_BASE, V_BASE + V_COUNT)) | \
        set(range(T_BASE + 1, T_BASE + T_COUNT))
    unsafe = set()
    for c in range(0x110000):
        if 0xD800 <= c <= 0xDFFF:
            continue
        if ccc.get(c, 0) or c in seconds:
            unsafe.add(c)
        elif c in decomp:
            d0 = decomp[c][0]
            if model.nfc([c]) != [c] or ccc.get(d0, 0) or d0 in seconds:
                unsafe.add(c)
    assert min(unsafe) == 0x300, hex(min(unsafe))  # the C code skips below U+0300
    # the boundary claim, for every decomposable safe code point after every composition first
    firsts = sorted({a for (a, _b) in comp} | set(range(L_BASE, L_BASE + L_COUNT)))
    for c in sorted(decomp):
        if c in unsafe:
            continue
        for a in firsts:
            assert model.nfc([a, c]) == model.nfc([a]) + model.nfc([c]), (hex(a), hex(c))

    ccc_ranges = valued_ranges(ccc)
    unsafe_ranges = ranges_of(lambda c: c in unsafe)
    pool, pool_at, dec_rows = [], {}, []
    for c in sorted(decomp):
        d = tuple(decomp[c])
        if d not in pool_at:
            pool_at[d] = len(pool)
            pool.extend(d)
        dec_rows.append((c, pool_at[d], len(d)))
    assert len(pool) < (1 << 24) and max(len(d) for d in decomp.values()) < 256
    comp_rows = sorted(((a << 21) | b, c) for (a, b), c in comp.items())

    meta = {
        "ud": ud_name, "ud_version": ud.unidata_version, "perl": perl_ucd,
        "n_classes": len(class_ranges), "n_ccc": len(ccc_ranges), "n_dec": len(dec_rows),
        "n_pool": len(pool), "n_comp": len(comp_rows), "n_unsafe": len(unsafe_ranges),
    }
    return meta, ascii_class, class_ranges, ccc_ranges, dec_rows, pool, comp_rows, unsafe_ranges


def header_comment(meta):
    return (
        "/* Generated by tools/gen_unicode.py from %(ud)s (Unicode %(ud_version)s) and, for the\n"
        " * Age property, Perl's Unicode::UCD (Unicode %(perl)s). Do not edit: change the script and\n"
        " * run it again (python3 tools/gen_unicode.py).\n"
        " *\n"
        " * - Classes L / N / M / White_Space: Unicode %(ud_version)s, as the regexes of Hugging\n"
        " *   Face tokenizers see them (Oniguruma 6.9.10).\n"
        " * - NFC data: Unicode " + NFC_VERSION + ".0 (the tables of unicode-normalization-alignments\n"
        " *   0.1.12, which tokenizers normalizes with): the data restricted to the code points\n"
        " *   assigned in " + NFC_VERSION + "; later code points are inert starters. */\n") % meta


def render(meta, ascii_class, class_ranges, ccc_ranges, dec_rows, pool, comp_rows, unsafe_ranges):
    h = header_comment(meta) + """#ifndef LOOM_UNICODE_TABLES_H
#define LOOM_UNICODE_TABLES_H

#include <stdint.h>

#define LOOM_UC_CATEGORY_VERSION "%(ud_version)s"
#define LOOM_UC_NFC_VERSION "%(nfc)s.0"

/* Character classes of the pre-tokenizer regexes. */
enum { LOOM_UC_OTHER = 0, LOOM_UC_L = 1, LOOM_UC_N = 2, LOOM_UC_WS = 3, LOOM_UC_M = 4 };

/* A run of code points [lo, hi] with a value v: hi_v = hi | v << 24. */
typedef struct loom_uc_range {
    uint32_t lo, hi_v;
} loom_uc_range;
#define LOOM_UC_HI(r) ((r).hi_v & 0xFFFFFFu)
#define LOOM_UC_V(r) ((r).hi_v >> 24)

extern const uint8_t loom_uc_ascii_class[128];
/* Runs of letters (L*), numbers (N*), White_Space and marks (M*), sorted,
 * disjoint. */
extern const loom_uc_range loom_uc_class_ranges[];
extern const uint32_t loom_uc_n_class_ranges;

/* NFC: canonical combining classes (non-zero), sorted runs. */
extern const loom_uc_range loom_uc_ccc_ranges[];
extern const uint32_t loom_uc_n_ccc_ranges;
/* Full canonical decompositions (Hangul syllables excluded: algorithmic):
 * code point loom_uc_decomp_cp[i] decomposes to loom_uc_decomp_pool[off, off + len)
 * with loom_uc_decomp_at[i] = off << 8 | len. Sorted by code point. */
extern const uint32_t loom_uc_decomp_cp[];
extern const uint32_t loom_uc_decomp_at[];
extern const uint32_t loom_uc_n_decomp;
extern const uint32_t loom_uc_decomp_pool[];
/* Primary composites (Hangul excluded): key first << 21 | second, sorted. */
extern const uint64_t loom_uc_comp_key[];
extern const uint32_t loom_uc_comp_val[];
extern const uint32_t loom_uc_n_comp;
/* Code points where NFC may change the text or join it to what precedes (all
 * at or above U+0300); a string starting with any other code point is a
 * normalization boundary. Sorted runs. */
extern const loom_uc_range loom_uc_nfc_unsafe[];
extern const uint32_t loom_uc_n_nfc_unsafe;

#endif /* LOOM_UNICODE_TABLES_H */
""" % dict(meta, nfc=NFC_VERSION)

    def rows(items, per_line, fmt):
        lines, line = [], []
        for it in items:
            line.append(fmt(it))
            if len(line) == per_line:
                lines.append("    " + " ".join(line))
                line = []
        if line:
            lines.append("    " + " ".join(line))
        return "\n".join(lines)

    rng = lambda r: "{0x%X, 0x%X}," % (r[0], r[1] | (r[2] << 24))
    rng2 = lambda r: "{0x%X, 0x%X}," % (r[0], r[1])
    c = header_comment(meta) + '#include "unicode_tables.h"\n\n'
    c += "const uint8_t loom_uc_ascii_class[128] = {\n%s\n};\n\n" % rows(ascii_class, 32, lambda v: "%d," % v)
    c += "const loom_uc_range loom_uc_class_ranges[] = {\n%s\n};\n" % rows(class_ranges, 4, rng)
    c += "const uint32_t loom_uc_n_class_ranges = %d;\n\n" % len(class_ranges)
    c += "const loom_uc_range loom_uc_ccc_ranges[] = {\n%s\n};\n" % rows(ccc_ranges, 4, rng)
    c += "const uint32_t loom_uc_n_ccc_ranges = %d;\n\n" % len(ccc_ranges)
    c += "const uint32_t loom_uc_decomp_cp[] = {\n%s\n};\n" % rows(dec_rows, 8, lambda r: "0x%X," % r[0])
    c += "const uint32_t loom_uc_decomp_at[] = {\n%s\n};\n" % rows(
        dec_rows, 8, lambda r: "0x%X," % ((r[1] << 8) | r[2]))
    c += "const uint32_t loom_uc_n_decomp = %d;\n" % len(dec_rows)
    c += "const uint32_t loom_uc_decomp_pool[] = {\n%s\n};\n\n" % rows(pool, 8, lambda v: "0x%X," % v)
    c += "const uint64_t loom_uc_comp_key[] = {\n%s\n};\n" % rows(comp_rows, 4, lambda r: "0x%XULL," % r[0])
    c += "const uint32_t loom_uc_comp_val[] = {\n%s\n};\n" % rows(comp_rows, 8, lambda r: "0x%X," % r[1])
    c += "const uint32_t loom_uc_n_comp = %d;\n\n" % len(comp_rows)
    c += "const loom_uc_range loom_uc_nfc_unsafe[] = {\n%s\n};\n" % rows(unsafe_ranges, 4, rng2)
    c += "const uint32_t loom_uc_n_nfc_unsafe = %d;\n" % len(unsafe_ranges)
    return h, c


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    ap.add_argument("--any-version", action="store_true",
                    help="accept a Unicode version other than %s for the categories" % CATEGORY_VERSION)
    args = ap.parse_args()
    h, c = render(*build(args.any_version))
    if args.check:
        bad = [p for p, text in ((OUT_H, h), (OUT_C, c))
               if not os.path.exists(p) or open(p, encoding="utf-8").read() != text]
        if bad:
            sys.exit("gen_unicode.py: out of date: %s" % ", ".join(bad))
        print("gen_unicode.py: up to date")
        return
    for p, text in ((OUT_H, h), (OUT_C, c)):
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)
        print("gen_unicode.py: wrote %s (%d bytes)" % (os.path.relpath(p, ROOT), len(text)))


if __name__ == "__main__":
    main()
