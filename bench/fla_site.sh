#!/usr/bin/env bash
# The transformers + flash-linear-attention peer's packages, as one archive
# small enough to carry to a GPU machine that cannot reach PyPI (issue 38).
#
#   bash bench/fla_site.sh pack ARCHIVE.tar.xz     # here, with network
#   bash bench/fla_site.sh unpack ARCHIVE.tar.xz DIR  # there; then PYTHONPATH=DIR
#
# pack downloads Triton 3.7.1 (the first Triton whose Hopper kernels fla 0.6
# accepts), fla-core and flash-linear-attention 0.6.0 and peft 0.21.2 for
# CPython 3.12 on x86-64 Linux, unpacks them into one directory and leaves
# out what neither fla nor transformers loads: Triton's bundled CUPTI and
# Nsight libraries (its profiler's), its Blackwell ptxas and an
# instrumentation test library; libtriton.so loses its debug sections
# (strip --strip-unneeded: 461 -> 180 MB). The wheel alone is 198 MB; the
# archive (xz) about 56 MB. unpack extracts it with Python's tarfile (no xz
# binary needed) and gives Triton's ptxas, cuobjdump and nvdisasm back
# their execute bits. Versions: FLA_SITE_TRITON, FLA_SITE_FLA, FLA_SITE_PEFT.
set -uo pipefail
die() { echo "fla_site.sh: $*" >&2; exit 2; }
usage="usage: bash bench/fla_site.sh pack ARCHIVE.tar.xz | unpack ARCHIVE.tar.xz DIR"
[ $# -ge 1 ] || die "$usage"
PY=${PYTHON:-python3}

case "$1" in
pack)
    [ $# -eq 2 ] || die "$usage"
    out=$2
    [[ $out == *.tar.xz ]] || die "the archive's name must end in .tar.xz (got '$out')"
    command -v strip > /dev/null || die "no strip (binutils) on PATH"
    command -v xz > /dev/null || die "no xz on PATH"
    tmp=$(mktemp -d) || die "mktemp failed"
    trap 'rm -rf "$tmp"' EXIT
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$tmp/whl" "triton==${FLA_SITE_TRITON:-3.7.1}" \
        "fla-core==${FLA_SITE_FLA:-0.6.0}" "flash-linear-attention==${FLA_SITE_FLA:-0.6.0}" \
        "peft==${FLA_SITE_PEFT:-0.21.2}" || die "pip download failed"
    mkdir -p "$tmp/site" || exit 1
    for w in "$tmp"/whl/*.whl; do
        "$PY" -m zipfile -e "$w" "$tmp/site" || die "could not unpack $w"
    done
    t=$tmp/site/triton
    [ -f "$t/_C/libtriton.so" ] || die "no triton/_C/libtriton.so in the Triton wheel"
    rm -rf "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/bin/ptxas-blackwell" \
        "$t/instrumentation/libGPUInstrumentationTestLib.so"
    strip --strip-unneeded "$t/_C/libtriton.so" || die "strip failed"
    chmod +x "$t"/backends/nvidia/bin/*
    tar -C "$tmp/site" -cf - . | xz -6 -T0 > "$out.part" || die "tar | xz failed"
    mv -f "$out.part" "$out" || die "could not write $out"
    echo "fla_site.sh: $out, $(du -m "$out" | cut -f1) MB: $(ls "$tmp/whl" | tr '\n' ' ')"
    ;;
unpack)
    [ $# -eq 3 ] || die "$usage"
    [ -f "$2" ] || die "no archive at $2 (make it with: bash bench/fla_site.sh pack $2)"
    mkdir -p "$3" || die "cannot make $3"
    # the "data" filter (Python >= 3.12, and 3.8.17+): no member outside DIR, no device files
    "$PY" -c 'import sys, tarfile
t = tarfile.open(sys.argv[1])
try:
    t.extractall(sys.argv[2], filter="data")
except TypeError:
    t.extractall(sys.argv[2])' "$2" "$3" || die "could not extract $2"
    chmod +x "$3"/triton/backends/nvidia/bin/* 2> /dev/null
    PYTHONPATH=$3 "$PY" -c 'import triton, fla; print("fla_site.sh: triton", triton.__version__,
"fla", fla.__version__, "from", triton.__file__.rsplit("/", 2)[0])' \
        || die "$3 does not import triton and fla"
    ;;
*) die "$usage" ;;
esac
