#!/usr/bin/env bash
# Copies the reference fixtures the tests use from a ../shared checkout into
# the repository, or checks that the copies have not drifted.
#
#   bash tools/sync_fixtures.sh                 ../shared/fixtures -> tests/fixtures
#   bash tools/sync_fixtures.sh --check         compare only (cmp), change nothing
#   bash tools/sync_fixtures.sh SRC [DEST]      another set, e.g.
#       bash tools/sync_fixtures.sh ../shared/fixtures_qwen3_5   (-> tests/fixtures_qwen3_5)
#
# What is copied: every file under SRC but its README.md (DEST/README.md is
# the repository's own: where the files came from, how to re-sync). Every one
# of them is used by the tests: tests/test_safetensors.c and tests/test_json.c
# walk the whole tree, the others name models, golden files and tokenizer
# cases. A file under DEST that SRC no longer has is reported, not removed.
# Relative paths are taken from the repository root. Exit 1 on drift (--check)
# or a missing SRC.
set -euo pipefail
cd "$(dirname "$0")/.."

check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
src=${1:-../shared/fixtures}
dest=${2:-tests/$(basename "$src")}
if [ ! -d "$src" ]; then
    echo "sync_fixtures: no $src (clone loom beside the shared checkout, or name the source: $0 SRC [DEST])" >&2
    exit 1
fi

files=$(cd "$src" && find . -type f ! -path ./README.md ! -name '.*' | sed 's|^\./||' | LC_ALL=C sort)
changed=0 drifted=0
IFS=$'\n'
for f in $files; do
    if cmp -s "$src/$f" "$dest/$f"; then continue; fi
    if [ "$check" = 1 ]; then
        echo "drifted: $dest/$f differs from $src/$f" >&2
        drifted=$((drifted + 1))
    else
        mkdir -p "$(dirname "$dest/$f")"
        # atomic: a copy beside the file, then a rename over it
        cp "$src/$f" "$dest/$f.sync-tmp" && mv -f "$dest/$f.sync-tmp" "$dest/$f"
        echo "copied $f"
        changed=$((changed + 1))
    fi
done
if [ -d "$dest" ]; then
    (cd "$dest" && find . -type f ! -name README.md ! -name '.*' | sed 's|^\./||' | LC_ALL=C sort) |
        while read -r f; do
            [ -f "$src/$f" ] || echo "note: $dest/$f is not in $src (remove it if no test uses it)" >&2
        done
fi
if [ "$check" = 1 ]; then
    if [ "$drifted" -gt 0 ]; then
        echo "sync_fixtures: $drifted file(s) differ; run: bash tools/sync_fixtures.sh $src $dest" >&2
        exit 1
    fi
    echo "sync_fixtures: $dest matches $src"
else
    echo "sync_fixtures: $changed file(s) copied into $dest; $dest/README.md is kept as it is"
fi
