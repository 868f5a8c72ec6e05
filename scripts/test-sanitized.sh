#!/usr/bin/env bash
# The native engine's C code under AddressSanitizer and UBSan (`make test` runs this after the
# suite): the extension built with them into a copy of the package, and the FUSE tests run
# against it. pytest starts with the sanitizer runtimes preloaded
# (the extension it imports needs them first); tests/conftest.py then takes LD_PRELOAD out of
# the environment of the programs the tests run (coreutils' dd aborts under a preloaded ASan)
# and tests/support/fusemount.py gives it back to the `atlasfs` commands, the mount daemons. A report
# from any daemon is a file in the log folder: any such file fails this stage.
# Usage: scripts/test-sanitized.sh VENV [TEST_FILE...] (the FUSE tests below when none is given)
set -euo pipefail
venv=$(cd "$1" && pwd)
shift
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
    tests=(tests/mount/test_native.py tests/mount/test_mount.py tests/mount/test_hardening_mount.py tests/mount/test_safety.py
           tests/mount/test_faults.py tests/mount/test_tarview.py tests/mount/test_located_reads.py tests/mount/test_located_kinds.py
           tests/mount/test_native_fifos.py tests/mount/test_native_memory.py tests/mount/test_decoded_cache.py
           tests/mount/test_order_mount.py tests/mount/test_located_big_blocks_mount.py tests/mount/test_located_frames.py)
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/atlasfs-sanitized-XXXXXX)
trap 'rm -rf "$work"' EXIT
cp -r "$repo/atlasfs" "$repo/setup.py" "$repo/pyproject.toml" "$work/"
find "$work/atlasfs" -name "*.so" -delete
(cd "$work" && ATLASFS_SANITIZE=1 "$venv/bin/python" setup.py -q build_ext --inplace 2>&1 | grep -v -i "warn" || true)
if ! ldd "$work"/atlasfs/fuse/_native*.so 2>/dev/null | grep -q libasan; then
    echo "test-sanitized: the native extension did not build with sanitizers" >&2
    exit 1
fi
mkdir "$work/reports"
cd "$repo"
# PYTHONSAFEPATH: the working folder (the repository, with its own unsanitized build) is not
# put first on sys.path, so that the copy above is what pytest and the daemons import.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
export PYTHONPATH="$work" PYTHONSAFEPATH=1 ATLASFS_TEST_SANITIZED=1
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:verify_asan_link_order=0:log_path=$work/reports/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$work/reports/ubsan"
native=$("$venv/bin/python" -c "import atlasfs.fuse._native as n; print(n.__file__)")
case "$native" in
    "$work"/*) ;;
    *) echo "test-sanitized: the tests would import $native, not the sanitized build" >&2; exit 1 ;;
esac
status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" || status=$?
if [ -n "$(ls -A "$work/reports")" ]; then
    echo "test-sanitized: sanitizer reports:" >&2
    cat "$work"/reports/* >&2
    exit 1
fi
[ "$status" -eq 0 ] || exit "$status"
echo "test-sanitized: no sanitizer report"
