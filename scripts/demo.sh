#!/usr/bin/env bash
# The main job on the built-in demo: write a dataset, mount it, look, archive a shard with tar
# and export it with atlasfs export, read both back with webdataset, unmount.
# Usage: scripts/demo.sh [VENV_BIN_DIR [DATASET]] (default .venv/bin and ./atlasfs-demo).
# The dataset stays at DATASET for the README's quick start (mount it, ls, umount: printed at
# the end); a later run reuses it, once atlasfs verify finds it sound.
set -euo pipefail
bin=${1:-.venv/bin}
dataset=${2:-atlasfs-demo}
atlasfs="$bin/atlasfs"
work=$(mktemp -d /tmp/atlasfs-demo-XXXXXX)
mnt="$work/mnt"
cleanup() {
    if grep -qs " $mnt " /proc/self/mountinfo; then "$atlasfs" umount -z "$mnt" || true; fi
    rm -rf "$work"
}
trap cleanup EXIT
step() { printf '\n==> %s\n' "$*"; }

if [ -e "$dataset" ]; then
    if ! "$atlasfs" verify -q "$dataset" >/dev/null 2>&1; then
        echo "demo: $dataset exists and is not a sound dataset; move it away (or delete it) and run again" >&2
        exit 1
    fi
    step "the demo dataset is already in $dataset (atlasfs verify finds it sound): reused"
else
    step "writing the demo dataset to $dataset (200 labelled images, 4 shards, shared zstd dictionary)"
    "$atlasfs" demo "$dataset"
fi
"$atlasfs" info "$dataset"

step "mounting it: atlasfs mount $dataset $mnt"
mkdir "$mnt"
"$atlasfs" mount "$dataset" "$mnt"

step "ls $mnt  (one folder per shard)"
ls "$mnt"
step "ls $mnt/0  (samples grouped by their __key__ folders)"
ls "$mnt/0"
first=$(find "$mnt/0" -type f | sed -n 1p)   # the first example's first file; not head: SIGPIPE under pipefail
base=$(basename "$first")
sample="$(dirname "$first")/${base%%.*}"   # a sample is <key>.<field>...
step "one sample's files: ls -l ${sample#$mnt/}.*"
ls -l "$sample".*
step "its label and metadata: cat ${sample#$mnt/}.cls ${sample#$mnt/}.json"
cat "$sample.cls"; echo
cat "$sample.json"; echo

step "archiving shard 0 with tar, keys clean (no ./ prefix); find lists it label folder by label folder:"
echo "    find $mnt/0 -type f -printf '%P\0' | tar cf $work/0.tar -C $mnt/0 --null --no-recursion -T -"
find "$mnt/0" -type f -printf '%P\0' | tar cf "$work/0.tar" -C "$mnt/0" --null --no-recursion -T -
ls -l "$work/0.tar"

step "exporting it in the dataset's example order, without FUSE: atlasfs export $dataset $work/export --shards 0"
"$atlasfs" export "$dataset" "$work/export" --shards 0

step "reading both tars back with the webdataset library"
"$bin/python" - "$work/0.tar" "$work/export/0.tar" <<'PY'
import sys
import webdataset as wds
found, exported = ([s for s in wds.WebDataset(path, shardshuffle=False).decode()] for path in sys.argv[1:])
first = exported[0]
print(f"{len(exported)} samples; the first: key={first['__key__']!r} cls={first['cls']!r} "
      f"json={first['json']!r} png={len(first['png'])} bytes")
assert len(found) == len(exported) == 50, (len(found), len(exported))
assert not any(s["__key__"].startswith("./") for s in found + exported), "keys must be clean"
assert sorted(s["__key__"] for s in found) == sorted(s["__key__"] for s in exported)
order = [s["json"]["index"] for s in exported]
assert order == sorted(order), "export keeps the dataset's example order"
print("find | tar holds the same samples, grouped by folder; export holds them in example order")
PY

step "unmounting: atlasfs umount $mnt"
"$atlasfs" umount "$mnt"
echo
echo "demo finished: mounted, listed, archived and exported a shard, read back its 50 samples, unmounted"
echo
echo "The demo dataset stays in $dataset. Mount it, look, unmount:"
echo
echo "mkdir -p /tmp/ds && $atlasfs mount $dataset /tmp/ds"
echo "ls /tmp/ds/0 | head"
echo "$atlasfs umount /tmp/ds"
