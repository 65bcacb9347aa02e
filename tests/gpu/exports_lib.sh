# Shared by tests/gpu/ckpt_exports.sh and moe_exports.sh (sourced): a token
# file of random words at $W/t.tokens (seed $1), and `run CMD...`, which
# counts a failure in $fails and shows the end of its log.
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
