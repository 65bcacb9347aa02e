# Shared by tests/gpu/ckpt_exports.sh and moe_exports.sh (sourced):
# `exports_setup NAME BUILD` (the loom of BUILD in $L, made when missing,
# and a new work dir in $W), a token file of random words at $W/t.tokens
# (seed $1), and `run CMD...`, which counts a failure in $fails and shows
# the end of its log.
exports_setup() {
    B=$2
    [ -x "$B/loom" ] || make -j"$(nproc)" CUDA=1 BUILD="$B" "$B/loom" >"/tmp/$1-exports-build.log" 2>&1 \
        || { tail -30 "/tmp/$1-exports-build.log"; exit 1; }
    L=$B/loom
    W=$(mktemp -d "/tmp/loom-$1-exports.XXXXXX")
}
make_tokens() {
    python3 - "$W/t.txt" "$1" <<'PY' || return 1
import random, sys
random.seed(int(sys.argv[2]))
words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "again"]
open(sys.argv[1], "w").write("\n\n".join(" ".join(random.choice(words) for _ in range(300))
                                         for _ in range(40)))
PY
    $L data --text "$W/t.txt" --out "$W/t.tokens" --log-level warn
}
fails=0
run() { "$@" >"$W/last.log" 2>&1 || { echo "FAIL: $*"; tail -20 "$W/last.log"; fails=$((fails + 1)); return 1; }; }
