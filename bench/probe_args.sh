#!/bin/bash
# The GPU probes', bench/profile.sh's, bench/ncu_source.sh's, bench/fla_site.sh's,
# bench/peer_hf.py's counts and bench/train_bench.sh's (LOOM_BENCH_GA, _MB, _LAYERS) argument checks, which run before any
# device work and so on any machine, and
# bench/kprof_table.py's and bench/ncu_source.py's self-tests
# (CI runs this after the CUDA build):
#   bash bench/probe_args.sh [build dir, default build-cuda]
# Each bad command line must exit 2 with its message on stderr.
set -u
B=${1:-build-cuda}
fail=0 n=0
expect() { # expect <message part> <command...>
    local want=$1 out rc
    shift
    n=$((n + 1))
    out=$("$@" 2>&1 >/dev/null)
    rc=$?
    if [ $rc -ne 2 ] || [[ "$out" != *"$want"* ]]; then
        echo "FAIL: $* -> rc $rc, stderr: $out (wanted rc 2 and '$want')"
        fail=1
    fi
}
expect "usage: power_probe sms|limiter" "$B/power_probe"
expect "usage: power_probe sms|limiter" "$B/power_probe" bogus
expect "usage: power_probe sms|limiter" "$B/power_probe" sms 6 7
expect "must be a number from 1 to 600 (got 'x')" "$B/power_probe" sms x
expect "must be a number from 1 to 600 (got '6x')" "$B/power_probe" limiter 6x
expect "must be a number from 1 to 600 (got '0')" "$B/power_probe" sms 0
expect "must be a number from 1 to 600 (got '1e9')" "$B/power_probe" sms 1e9
expect "usage: $B/gemm_sm90 [group_m: 1..64" "$B/gemm_sm90" 0
expect "usage: $B/gemm_sm90 [group_m: 1..64" "$B/gemm_sm90" 8x
expect "usage: $B/gemm_sm90 [group_m: 1..64" "$B/gemm_sm90" 8 nope
expect "usage: $B/gemm_sm90 [group_m: 1..64" "$B/gemm_sm90" 8 dx extra
expect "unknown case 'foo'" bash bench/profile.sh foo
expect "1 <= first < last <= 1000 (got '3' '3')" bash bench/profile.sh 8b-lora 3 3
expect "1 <= first < last <= 1000 (got '0' '3')" bash bench/profile.sh 8b-lora 0 3
expect "usage: bash bench/profile.sh" bash bench/profile.sh 8b-lora 3 8 9
expect "no loom binary at /nonexistent/loom" env LOOM_BIN=/nonexistent/loom bash bench/profile.sh
expect "no tracer at /nonexistent/kprof.so" env LOOM_BIN="$B/loom" LOOM_KPROF_LIB=/nonexistent/kprof.so bash bench/profile.sh
expect "LOOM_BENCH_GA=0: give the micro-batches" env LOOM_BENCH_GA=0 bash bench/train_bench.sh tiny-full
expect "LOOM_BENCH_GA=2x: give the micro-batches" env LOOM_BENCH_GA=2x bash bench/train_bench.sh tiny-full
expect "LOOM_BENCH_MB=0: give the sequences a micro-batch" env LOOM_BENCH_MB=0 bash bench/train_bench.sh tiny-full
expect "LOOM_BENCH_MB=1.5: give the sequences a micro-batch" env LOOM_BENCH_MB=1.5 bash bench/train_bench.sh tiny-full
expect "--grad-accum 0: give a count of at least 1" python3 bench/peer_hf.py --model m --data d --steps 2 --grad-accum 0
expect "--micro-batch-size 0: give a count of at least 1" python3 bench/peer_hf.py --model m --data d --steps 2 --micro-batch-size 0
expect "LOOM_BENCH_LAYERS=x: give a number of layers" env LOOM_BENCH_LAYERS=x bash bench/train_bench.sh tiny-full
expect "give LOG and --steps N" python3 bench/kprof_table.py
expect "no kprof report" python3 bench/kprof_table.py /dev/null --steps 2
python3 bench/kprof_table.py --self-test || fail=1
expect "usage: bash bench/ncu_source.sh" bash bench/ncu_source.sh q35-4b-lora
expect "unknown case 'foo'" bash bench/ncu_source.sh foo chunk_bwd
expect "give the kernel's name" bash bench/ncu_source.sh q35-4b-lora ""
expect "skip is a count of launches" bash bench/ncu_source.sh q35-4b-lora chunk_bwd 1x
expect "no loom binary at /nonexistent/loom" env LOOM_BIN=/nonexistent/loom bash bench/ncu_source.sh q35-4b-lora chunk_bwd
expect "no Nsight Compute ('/nonexistent/ncu'" env LOOM_BIN="$B/loom" NCU=/nonexistent/ncu bash bench/ncu_source.sh q35-4b-lora chunk_bwd
expect "give the CSV of ncu's source page" python3 bench/ncu_source.py
expect "not an ncu source page" python3 bench/ncu_source.py /dev/null
python3 bench/ncu_source.py --self-test || fail=1
expect "usage: bash bench/fla_site.sh pack" bash bench/fla_site.sh
expect "usage: bash bench/fla_site.sh pack" bash bench/fla_site.sh unzip x
expect "usage: bash bench/fla_site.sh pack" bash bench/fla_site.sh unpack x
expect "must end in .tar.xz (got 'x.zip')" bash bench/fla_site.sh pack x.zip
expect "no archive at /nonexistent/a.tar.xz" bash bench/fla_site.sh unpack /nonexistent/a.tar.xz /tmp
[ $fail -eq 0 ] && echo "probe and profile arguments: $n checks passed"
exit $fail
