#!/usr/bin/env python3
"""loom's tokenizer against Hugging Face `tokenizers`, one thread each.

    python3 bench/tokenizer_bench.py TOKENIZER_JSON TEXT [--repeat N] [--lines]
                                     [--add-special] [--loom-bench PATH]
    python3 bench/tokenizer_bench.py TOKENIZER_JSON --unicode-check

The first form encodes TEXT with both (the whole file as one text, or with
--lines every line as its own text, as a data pipeline encodes documents),
checks that the ids are identical, and prints MB/s (10^6 input bytes per
second, best of N passes) of each and the ratio loom / HF. Hugging Face runs
with TOKENIZERS_PARALLELISM=false and RAYON_NUM_THREADS=1, calling
Tokenizer.encode (not encode_batch) per text; loom runs build/tokenizer_bench
(built with `make bench-tokenizer` unless --loom-bench names a binary).

--unicode-check encodes probe texts holding every Unicode code point in
several contexts (letters, digits, marks, spaces, apostrophes, newlines)
with both and compares the ids: the check that loom's Unicode tables
(categories and normalization) agree with the installed `tokenizers`.

Exit status: 0 when the ids agree, 1 when they differ, 2 on usage errors.
Needs: pip install tokenizers (any recent version; the tables were checked
against 0.23.3).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_loom(make_args):
    subprocess.check_call(["make", "-C", ROOT, "-j2", "bench-tokenizer"] + make_args,
                          stdout=subprocess.DEVNULL)
    return os.path.join(ROOT, "build", "tokenizer_bench")


def read_texts(path, lines):
    data = open(path, "rb").read()
    text = data.decode("utf-8")  # loom refuses invalid UTF-8 too
    return len(data), (text.split("\n") if lines else [text])


def run_loom(binary, tok, text_path, repeat, lines, add_special):
    with tempfile.NamedTemporaryFile("r", suffix=".ids", delete=False) as f:
        ids_path = f.name
    cmd = [binary, tok, text_path, "--repeat", str(repeat), "--ids-out", ids_path]
    if lines:
        cmd.append("--lines")
    if add_special:
        cmd.append("--add-special")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit("tokenizer_bench.py: %s failed:\n%s%s" % (" ".join(cmd), out.stdout, out.stderr))
    print(out.stdout.rstrip())
    stats = dict(kv.split("=") for kv in out.stdout.strip().split("\n")[-1].split())
    ids = [[int(x) for x in line.split()] for line in open(ids_path).read().split("\n")[:-1]]
    os.unlink(ids_path)
    return float(stats["loom_mb_per_s"]), ids


def run_hf(tok_path, texts, nbytes, repeat, add_special):
    from tokenizers import Tokenizer, __version__
    t0 = time.perf_counter()
    tok = Tokenizer.from_file(tok_path)
    load = time.perf_counter() - t0
    best, ids = float("inf"), None
    for r in range(repeat):
        t1 = time.perf_counter()
        out = [tok.encode(t, add_special_tokens=add_special).ids for t in texts]
        dt = time.perf_counter() - t1
        best = min(best, dt)
        if ids is None:
            ids = out
    mbs = nbytes / 1e6 / best
    print("hf tokenizers %s: loaded in %.3f s; encode, one thread, best of %d: %.3f s = %.2f MB/s"
          % (__version__, load, repeat, best, mbs))
    return mbs, ids


def compare(loom_ids, hf_ids, texts):
    if len(loom_ids) != len(hf_ids):
        print("MISMATCH: %d texts from loom, %d from HF" % (len(loom_ids), len(hf_ids)))
        return False
    bad = 0
    for k, (a, b) in enumerate(zip(loom_ids, hf_ids)):
        if a != b:
            bad += 1
            if bad <= 3:
                i = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
                print("MISMATCH in text %d at token %d: loom %s, HF %s; text %r"
                      % (k, i, a[i:i + 8], b[i:i + 8], texts[k][:120]))
    if bad:
        print("ids differ in %d of %d texts" % (bad, len(texts)))
        return False
    print("ids identical: %d texts, %d tokens" % (len(texts), sum(map(len, hf_ids))))
    return True


def unicode_probe():
    """Texts holding every code point (surrogates excepted) in several contexts."""
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    texts = []
    for i in range(0, len(cps), 96):
        parts = []
        for c in cps[i:i + 96]:
            ch = chr(c)
            parts.append("a@b @1@@x '@ @@\u0301x\u0301@, 1@\n@\r\n @  @ ".replace("@", ch))
        texts.append("".join(parts))
    return texts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tokenizer", help="tokenizer.json (or a directory holding one)")
    ap.add_argument("text", nargs="?", help="a UTF-8 text file")
    ap.add_argument("--repeat", type=int, default=5, help="passes; the best is reported (5)")
    ap.add_argument("--lines", action="store_true", help="encode every line as its own text")
    ap.add_argument("--add-special", action="store_true", help="apply the post-processor")
    ap.add_argument("--loom-bench", help="the tokenizer_bench binary (default: make bench-tokenizer)")
    ap.add_argument("--unicode-check", action="store_true",
                    help="compare ids on every code point instead of timing TEXT")
    ap.add_argument("--make-arg", action="append", default=[], help="extra make argument (repeatable)")
    args = ap.parse_args()
    tok = args.tokenizer
    if os.path.isdir(tok):
        tok = os.path.join(tok, "tokenizer.json")
    binary = args.loom_bench or build_loom(args.make_arg)

    if args.unicode_check:
        texts = unicode_probe()
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
            f.write("\n".join(t.replace("\n", "\u2029") for t in texts))
            path = f.name
        # one text per line: newlines inside a probe are written as U+2029 and
        # put back here, so both sides see the same texts
        probe = [t.replace("\n", "\u2029") for t in texts]
        _, loom_ids = run_loom(binary, tok, path, 1, True, args.add_special)
        os.unlink(path)
        _, hf_ids = run_hf(tok, probe, sum(len(t.encode()) for t in probe), 1, args.add_special)
        ok = compare(loom_ids, hf_ids, probe)
        sys.exit(0 if ok else 1)

    if not args.text:
        ap.error("TEXT is needed (or --unicode-check)")
    nbytes, texts = read_texts(args.text, args.lines)
    loom_mbs, loom_ids = run_loom(binary, tok, args.text, args.repeat, args.lines, args.add_special)
    hf_mbs, hf_ids = run_hf(tok, texts, nbytes, args.repeat, args.add_special)
    ok = compare(loom_ids, hf_ids, texts)
    print("loom %.2f MB/s, HF %.2f MB/s: loom / HF = %.2fx" % (loom_mbs, hf_mbs, loom_mbs / hf_mbs))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
