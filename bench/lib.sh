# Shared by bench/train_bench.sh and bench/topology.sh (sourced, not run).
# The caller sets T0 (start, in $SECONDS), RUN_TIMEOUT (seconds per run) and
# RUN_TIMEOUT_NAME (the variable that sets it, for the message); DRY=1 prints
# the commands of run_logged without running them.

say() { echo "[$(printf '%4d' $((SECONDS - T0)))s] $*"; }
show_cmd() { printf '$'; printf ' %q' "$@"; echo; }

# run_logged LOG CMD...: prints the command, runs it (under timeout) with its
# output in LOG, shows its progress lines as they come (rank 0's steps, the
# end, memory, errors); returns the command's status.
run_logged() {
    local log=$1
    shift
    show_cmd "$@"
    [ "${DRY:-0}" = 1 ] && return 0
    local t=$SECONDS
    timeout -k 15 "$RUN_TIMEOUT" "$@" < /dev/null 2>&1 | tee "$log" |
        grep --line-buffered -E '^(\[rank 0/[0-9]+\] )?(step (1|2|[0-9]*[05])/|trained |peer: |Traceback)|peak GPU memory|max RSS|out of memory|OutOfMemory|[Ee]rror:|ERROR' |
        sed -u 's/^/    /'
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && echo "    (killed: over $RUN_TIMEOUT_NAME=$RUN_TIMEOUT s)" | tee -a "$log"
    if [ "$rc" -ne 0 ]; then
        echo "    --- exit $rc after $((SECONDS - t)) s; the log's last lines:"
        tail -15 "$log" | sed 's/^/    | /'
    else
        echo "    --- done in $((SECONDS - t)) s"
    fi
    return "$rc"
}
