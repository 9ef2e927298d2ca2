#!/bin/bash
# CetraFS metadata benchmark: stat every file of a big tree, twice, with the kernel's caches
# dropped before each pass, on one node mounted with small cache budgets. Shows whether the
# per-file cost stays flat as the daemon's caches fill (issue 8: it used to fall 20x past
# 100,000 inodes) and whether the daemon's memory stays within its budget.
#
# Steps: make a volume on a sparse file LUN under $BENCH_DIR, mount it (one node, -o
# inode_cache=$STAT_BUDGET_MIB,meta_cache=$STAT_META_MIB,bitmap_cache=$STAT_BITMAP_MIB), warm
# up (below), create DIRS x FILES empty files with mknod from 4 parallel python3 processes
# (timed), then twice: sync, `echo 3 > /proc/sys/vm/drop_caches`, and walk the tree in order (listdir + lstat of every
# file, as find or ls -l do), printing the rate of each SLICE-file slice and its ratio to the
# pass's first slice (the bar: every slice within 2x, i.e. ratio >= 0.5) and the daemon's RSS
# after the pass. After the second pass the kernel's caches are dropped once more (the kernel
# FORGETs every inode). The memory bar: the RSS after each pass within the daemon's budget,
#   fixed overhead + inode_cache + meta_cache + bitmap_cache + threads' term (at that moment)
# (the three caches' configured bounds: the inode table, the metadata block cache and the
# allocator's cache of allocation group bitmaps, which the creates load).
# * The threads' term: what the threads' stacks and the FUSE workers' request buffers hold
#   resident (fuser reads every request into one 16 MiB buffer per worker; the pages a request
#   fills stay resident, so each worker holds as much as the largest request it has received:
#   a 1 MiB write, or a batch of FORGETs after drop_caches). bench/thread_memory.py measures it
#   page by page from the threads' stack pointers and the workers' read(2) buffers, whatever
#   mappings the kernel merged; memory it cannot attribute counts against the budget.
# * The fixed overhead: the daemon's RSS after a warm-up, minus the threads' term and the three
#   caches' own charges at that moment. The warm-up runs the benchmark's code paths once on
#   STAT_WARMUP files in a directory the passes do not walk: mkdir + mknod, drop the kernel's
#   caches, listdir + lstat, drop them again; then the script waits until no cache has
#   logged a change for a whole reporting period (5 s) and reads the RSS, the threads' term
#   and the caches' latest logged charges together. That is the code, libraries and volume
#   state (group summaries, journal and lock bookkeeping) the daemon keeps whatever the caches
#   hold; the caches may not use it. The RSS right after mount is shown as context.
# The caches' own accounts (their debug log lines) are shown too. The summary prints each
# criterion with PASS or MISS: the slowest slice's ratio, and the RSS after pass 2 with its
# budget and the margin (after pass 1 and after the final forget as context), and for each
# reading what no term accounts for: RSS - (fixed overhead + the caches' charges then +
# threads' term), and how much more malloc has allocated outside the caches than at the
# warm-up (its in-use bytes, logged by the daemon, minus the caches' charges): growth there is
# allocations no cache charges; the rest of what no term accounts for is freed heap that
# stayed resident. The exit status
# is 0 unless the run itself broke. JSON to bench/results/<timestamp>-stat-tree.json; the
# daemon's log and a copy of /proc/PID/smaps at each measurement stay in the run's directory
# under $BENCH_DIR.
#
# Usage: bench/stat-tree.sh
# Environment: STAT_DIRS (default 300), STAT_FILES (per directory, default 1000; the tree has
#   STAT_DIRS x STAT_FILES files, e.g. STAT_DIRS=60 for 60,000), STAT_SLICE (default 20000),
#   STAT_WARMUP (warm-up files, default 100), STAT_BUDGET_MIB (inode_cache=, default 16),
#   STAT_META_MIB (meta_cache=, default 16), STAT_BITMAP_MIB (bitmap_cache=, default 2),
#   BENCH_DIR (default <repo>/.cache/bench),
#   CETRA_BIN_DIR (default target/release; built if missing).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
case ${1:-} in
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "stat-tree: no arguments expected (see --help)" >&2; exit 1 ;;
esac
DIRS=${STAT_DIRS:-300}
FILES=${STAT_FILES:-1000}
SLICE=${STAT_SLICE:-20000}
WARMUP=${STAT_WARMUP:-100}
BUDGET_MIB=${STAT_BUDGET_MIB:-16}
META_MIB=${STAT_META_MIB:-16}
BITMAP_MIB=${STAT_BITMAP_MIB:-2}
BENCH_DIR=${BENCH_DIR:-$REPO/.cache/bench}
BIN_DIR=${CETRA_BIN_DIR:-$REPO/target/release}

die() { echo "stat-tree: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "run as root (FUSE mount, drop_caches)"
command -v python3 >/dev/null || die "python3 is needed"
[[ -e /dev/fuse ]] || die "/dev/fuse is missing"
if [[ ! -x $BIN_DIR/mount-cetra || ! -x $BIN_DIR/mkfs-cetra ]]; then
    echo "stat-tree: building release binaries"
    (cd "$REPO" && cargo build --release --bins -q)
fi

mkdir -p "$BENCH_DIR" "$REPO/bench/results"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
WORK=$(mktemp -d "$BENCH_DIR/stat-tree-$STAMP-XXXX")
LUN=$WORK/lun.img
MNT=$WORK/mnt
LOG=$WORK/mount.log
mkdir -p "$MNT"
MOUNTED=0
cleanup() {
    if ((MOUNTED)); then
        umount "$MNT" 2>/dev/null || fusermount3 -u "$MNT" 2>/dev/null || true
    fi
    rm -f "$LUN"
}
trap cleanup EXIT

# Inode blocks (4 KiB a file), directory trees and 16 journals of 64 MiB.
truncate -s $(((DIRS * FILES * 4096 * 3 / 2) + (3 << 30))) "$LUN"
"$BIN_DIR/mkfs-cetra" -q --force -L stat-tree "$LUN"
RUST_LOG=info,fuser::session=error,cetrafs_core::fs::inode_table=debug,cetrafs_core::fs::block_cache=debug,cetrafs_core::fs::heap=debug,cetrafs_core::fs::inode_lock=debug \
    CETRA_LOG_FILE=$LOG "$BIN_DIR/mount-cetra" "$LUN" "$MNT" -o "host=bench,inode_cache=$BUDGET_MIB,meta_cache=$META_MIB,bitmap_cache=$BITMAP_MIB"
MOUNTED=1
PID=$(pgrep -f "^$BIN_DIR/mount-cetra $LUN $MNT " | head -1)
[[ -n $PID ]] || die "no mount-cetra daemon found for $MNT"
echo "stat-tree: $DIRS x $FILES files on $(df --output=fstype "$WORK" | tail -1) ($LUN), inode_cache=$BUDGET_MIB MiB, meta_cache=$META_MIB MiB, bitmap_cache=$BITMAP_MIB MiB, daemon pid $PID"

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$PID/status"; }
# Resident KiB of the threads' stacks and the FUSE workers' request buffers (see the header);
# measure_threads sets THREADS_KIB and THREADS_JSON (the details).
THREADS_STATE=$WORK/thread-buffers.json
# Each measurement also keeps a copy of /proc/PID/smaps in the run's directory (for analysis).
measure_threads() {
    cp "/proc/$PID/smaps" "$WORK/smaps-$1.txt"
    THREADS_JSON=$(python3 "$REPO/bench/thread_memory.py" "$PID" "$THREADS_STATE")
    THREADS_KIB=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["kib"])' "$THREADS_JSON")
}
threads_detail() { python3 -c 'import json, sys; print(json.loads(sys.argv[1])["summary"])' "$THREADS_JSON"; }
# The caches' latest accounts (logged at debug level every 5 s when they changed; the block
# cache's line ends with the allocator's bitmap cache: "...; allocation bitmaps: ...").
table_line() { grep -h "inode table:" "$LOG" | tail -1 | sed 's/^.*inode table: //'; }
cache_line() { grep -h "metadata block cache:" "$LOG" | tail -1 | sed 's/^.*metadata block cache: //'; }
# KiB the caches charge, from their latest lines ("= N KiB of", "(N KiB allocated",
# "allocation bitmaps: G groups = N KiB of").
table_kib() { table_line | sed -n 's/.* = \([0-9]*\) KiB of .*/\1/p'; }
cache_kib() { cache_line | sed -n 's/^[^(]*(\([0-9]*\) KiB allocated.*/\1/p'; }
bitmap_kib() { cache_line | sed -n 's/.*allocation bitmaps: [0-9]* groups = \([0-9]*\) KiB of .*/\1/p'; }
# What glibc's malloc has allocated (KiB, "malloc: N KiB in use"), to compare with the charges:
# allocations no cache charges show as in-use growth, free heap pages left resident do not.
malloc_kib() { grep -h "malloc: " "$LOG" | tail -1 | sed -n 's/.*malloc: \([0-9]*\) KiB in use.*/\1/p'; }
report_lines() { grep -c "inode table:\|metadata block cache:" "$LOG" || true; }
# Every measurement is read when the daemon is quiet, the same way for the baseline and after
# each pass: the RSS, the threads' term and the caches' charges are read, and kept if no cache
# logs a change in the next 6 s (more than the reporting period, 5 s: the charges logged last
# are those of the moment read, and the once-a-second trim has run after the last request);
# else read again, up to 6 times. Sets SAMPLE_RSS, SAMPLE_TABLE, SAMPLE_CACHE, SAMPLE_BITMAP,
# THREADS_KIB and
# THREADS_JSON; fails if the daemon never went quiet (the last reading is kept).
quiet_sample() {
    local lines
    for _ in 1 2 3 4 5 6; do
        lines=$(report_lines)
        SAMPLE_RSS=$(rss_kib)
        measure_threads "$1"
        SAMPLE_TABLE=$(table_kib)
        SAMPLE_CACHE=$(cache_kib)
        SAMPLE_BITMAP=$(bitmap_kib)
        SAMPLE_MALLOC=$(malloc_kib)
        sleep 6
        [[ $(report_lines) == "$lines" ]] && return 0
    done
    return 1
}
drop_caches() {
    sync
    echo 3 >/proc/sys/vm/drop_caches
    # FORGETs are sent asynchronously; let them arrive and the reporter (5 s) log and trim.
    sleep 7
}

RSS_MOUNTED=$(rss_kib)
echo "  daemon RSS right after mount ${RSS_MOUNTED} KiB (context)"

# The warm-up (see the header): the benchmark's code paths once, outside the walked tree.
WARM_DIR=warmup
python3 - "$MNT/$WARM_DIR" "$WARMUP" <<'PY'
import os, sys
d, n = sys.argv[1], int(sys.argv[2])
os.mkdir(d)
for f in range(n):
    os.mknod(os.path.join(d, f"f{f:05}"), 0o644)
PY
drop_caches
python3 - "$MNT/$WARM_DIR" <<'PY'
import os, sys
for name in sorted(os.listdir(sys.argv[1])):
    os.lstat(os.path.join(sys.argv[1], name))
PY
drop_caches
quiet_sample warmup || die "the caches kept changing for 36 s after the warm-up; no baseline"
RSS_WARM=$SAMPLE_RSS
THREADS_WARM=$THREADS_KIB
TABLE_WARM=$SAMPLE_TABLE
CACHE_WARM=$SAMPLE_CACHE
BITMAP_WARM=$SAMPLE_BITMAP
MALLOC_WARM=${SAMPLE_MALLOC:-0}
[[ -n $TABLE_WARM && -n $CACHE_WARM && -n $BITMAP_WARM ]] || die "no inode table, block cache or bitmap cache account in $LOG after the warm-up (RUST_LOG?)"
FIXED_KIB=$((RSS_WARM - THREADS_WARM - TABLE_WARM - CACHE_WARM - BITMAP_WARM))
CACHES_KIB=$(((BUDGET_MIB + META_MIB + BITMAP_MIB) * 1024))
echo "  after the warm-up ($WARMUP files): daemon RSS $RSS_WARM KiB = fixed overhead $FIXED_KIB KiB + threads' term $THREADS_WARM KiB + inode table $TABLE_WARM KiB + block cache $CACHE_WARM KiB + bitmap cache $BITMAP_WARM KiB"
echo "    threads: $(threads_detail)"
echo "  budget = fixed overhead $FIXED_KIB KiB + inode_cache + meta_cache + bitmap_cache ($CACHES_KIB KiB) + the threads' term at the time"
budget_kib() { echo $((FIXED_KIB + CACHES_KIB + $1)); }
# within RSS_KIB THREADS_KIB
within() {
    local b
    b=$(budget_kib "$2")
    if (($1 <= b)); then echo "within the $b KiB budget by $((b - $1)) KiB"; else echo "OVER the $b KiB budget by $(($1 - b)) KiB"; fi
    echo "      threads' term $2 KiB: $(threads_detail)"
}

python3 - "$MNT" "$DIRS" "$FILES" <<'PY'
import os, sys, time
from multiprocessing import Pool

mnt, dirs, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def make(d):
    p = os.path.join(mnt, f"d{d:04}")
    os.mkdir(p)
    for f in range(files):
        os.mknod(os.path.join(p, f"f{f:05}"), 0o644)
    return files

t0 = time.monotonic()
with Pool(4) as pool:
    n = sum(pool.map(make, range(dirs), chunksize=1))
dt = time.monotonic() - t0
print(f"  created {n} files in {dirs} directories in {dt:.1f}s ({n / dt:.0f} files/s, 4 processes, mknod)")
PY

RESULTS=$WORK/passes
mkdir -p "$RESULTS"
declare -a RSS_END=() RSS_AFTER=() THREADS_AFTER=() THREADS_DETAIL=() CHARGED=()
for pass in 1 2; do
    drop_caches
    echo "  pass $pass: caches dropped, daemon RSS $(($(rss_kib) >> 10)) MiB; table: $(table_line)"
    python3 - "$MNT" "$SLICE" "$RESULTS/pass$pass.json" "$WARM_DIR" <<'PY'
import json, os, sys, time

mnt, slice_n, out, warm = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rates, n, t = [], 0, time.monotonic()
for d in sorted(set(os.listdir(mnt)) - {warm}):
    p = os.path.join(mnt, d)
    for name in sorted(os.listdir(p)):
        os.lstat(os.path.join(p, name))
        n += 1
        if n % slice_n == 0:
            now = time.monotonic()
            rates.append(slice_n / (now - t))
            t = now
json.dump({"files": n, "rates": rates}, open(out, "w"))
PY
    RSS_END[pass]=$(rss_kib)
    quiet_sample "pass$pass" || echo "  WARNING: the daemon did not go quiet within 36 s after pass $pass; its last reading is used"
    RSS_AFTER[pass]=$SAMPLE_RSS
    THREADS_AFTER[pass]=$THREADS_KIB
    THREADS_DETAIL[pass]=$THREADS_JSON
    CHARGED[pass]="$SAMPLE_TABLE $SAMPLE_CACHE $SAMPLE_BITMAP ${SAMPLE_MALLOC:-0}"
    echo "  pass $pass done: daemon RSS ${RSS_END[pass]} KiB as the walk ended, ${RSS_AFTER[pass]} KiB when quiet, $(within "${RSS_AFTER[pass]}" "${THREADS_AFTER[pass]}") (the kernel still references every inode)"
    echo "    table: $(table_line)"
    echo "    block cache: $(cache_line)"
done
drop_caches
quiet_sample forgotten || echo "  WARNING: the daemon did not go quiet within 36 s after the final forget; its last reading is used"
RSS_FORGOTTEN=$SAMPLE_RSS
THREADS_FORGOTTEN=$THREADS_KIB
THREADS_DETAIL[3]=$THREADS_JSON
CHARGED[3]="$SAMPLE_TABLE $SAMPLE_CACHE $SAMPLE_BITMAP ${SAMPLE_MALLOC:-0}"
TABLE=$(table_line)
CACHE=$(cache_line)
echo "  after dropping the caches again: daemon RSS $((RSS_FORGOTTEN >> 10)) MiB, $(within "$RSS_FORGOTTEN" "$THREADS_FORGOTTEN"); table: $TABLE"
umount "$MNT"
MOUNTED=0

OUT=$REPO/bench/results/$STAMP-stat-tree.json
python3 - "$RESULTS" "$OUT" "$SLICE" "$BUDGET_MIB" "$META_MIB" "$BITMAP_MIB" "$RSS_MOUNTED" "$RSS_WARM" "$FIXED_KIB" "$TABLE_WARM" "$CACHE_WARM" "$BITMAP_WARM" \
    "${RSS_AFTER[1]}" "${RSS_AFTER[2]}" "$RSS_FORGOTTEN" "$TABLE" "$CACHE" \
    "$THREADS_WARM" "${THREADS_AFTER[1]}" "${THREADS_AFTER[2]}" "$THREADS_FORGOTTEN" "${THREADS_DETAIL[1]}" "${THREADS_DETAIL[2]}" "${THREADS_DETAIL[3]}" \
    "${RSS_END[1]}" "${RSS_END[2]}" "${CHARGED[1]}" "${CHARGED[2]}" "${CHARGED[3]}" "$MALLOC_WARM" <<'PY'
import json, os, platform, sys

(res, out, slice_n, budget, meta, bitmap, rss0, rss_w, fixed, table_w, cache_w, bitmap_w, rss1, rss2, rss_f, table, cache,
 th_w, th1, th2, th_f, d1, d2, d_f, end1, end2, ch1, ch2, ch_f, malloc_w) = sys.argv[1:]
fixed = int(fixed)
caches = (int(budget) + int(meta) + int(bitmap)) * 1024
# The caches' charges (inode table, block cache, bitmaps; KiB) and malloc's in-use KiB at each
# reading.
charged = [[int(x) for x in c.split()] for c in (ch1, ch2, ch_f)]
malloc = [c.pop() for c in charged]
# Allocated outside every cache at the warm-up (malloc in use minus the charges then).
outside_w = int(malloc_w) - int(table_w) - int(cache_w) - int(bitmap_w)
# Each measurement's budget: the fixed overhead, both caches' budgets and the threads' term then.
checks = [(int(r), fixed + caches + int(t), int(t)) for r, t in ((rss1, th1), (rss2, th2), (rss_f, th_f))]
details = [json.loads(d) for d in (d1, d2, d_f)]
passes = [json.load(open(os.path.join(res, f"pass{i}.json"))) for i in (1, 2)]
print(f"\nstat rate per {slice_n}-file slice (files/s) and ratio to the pass's first slice")
print(f"{'slice':>6}{'files':>10}{'pass 1':>10}{'ratio':>7}{'pass 2':>10}{'ratio':>7}")
worst = 1.0
for i in range(max(len(p["rates"]) for p in passes)):
    row = f"{i + 1:>6}{(i + 1) * int(slice_n):>10}"
    for p in passes:
        r = p["rates"][i] if i < len(p["rates"]) else None
        q = r / p["rates"][0] if r else None
        if q:
            worst = min(worst, q)
        row += f"{r:>10.0f}{q:>7.2f}" if r else f"{'-':>10}{'-':>7}"
    print(row)
print(f"daemon RSS (quiet): {int(rss0)} KiB after mount, {int(rss_w)} KiB after the warm-up, {int(rss1)} KiB after pass 1, "
      f"{int(rss2)} KiB after pass 2, {int(rss_f)} KiB after the kernel forgot the inodes; as each walk ended "
      f"(before the daemon's next trim): {int(end1)} and {int(end2)} KiB")
print(f"fixed overhead {fixed} KiB = {int(rss_w)} KiB RSS after the warm-up - {int(th_w)} threads' term "
      f"- {int(table_w)} inode table - {int(cache_w)} block cache - {int(bitmap_w)} bitmap cache (their logged charges then)")
mark = lambda ok: "PASS" if ok else "MISS"
print("\ncriteria (issue 8):")
print(f"  [{mark(worst >= 0.5)}] every {slice_n}-file slice within 2x of its pass's first slice: "
      f"slowest {worst:.2f} (bar: >= 0.50)")
for name, (r, b, t), d, c, m in zip(("after pass 2", "after pass 1", "after the kernel forgot"), (checks[1], checks[0], checks[2]),
                                    (details[1], details[0], details[2]), (charged[1], charged[0], charged[2]),
                                    (malloc[1], malloc[0], malloc[2])):
    what = "the criterion" if name == "after pass 2" else "context"
    un = ", ".join(d["unattributed"]) or "none"
    print(f"  [{mark(r <= b)}] RSS {name} within the budget ({what}): RSS {r} KiB, budget {b} KiB "
          f"= {fixed} fixed + {budget} MiB inode_cache + {meta} MiB meta_cache + {bitmap} MiB bitmap_cache + {t} threads' term "
          f"({d['stacks']}/{d['threads']} stacks, {d['buffers']}/{d['workers']} buffers; unattributed: {un}); margin {b - r} KiB")
    print(f"         charged then: inode table {c[0]} + block cache {c[1]} + bitmap cache {c[2]} KiB; "
          f"RSS - (fixed + charges + threads' term) = {r - fixed - sum(c) - t} KiB accounted by no term; "
          f"malloc in use {m} KiB, {m - sum(c) - outside_w:+} KiB outside the caches against the warm-up")
ok = checks[1][0] <= checks[1][1]
print(f"inode table: {table}")
print(f"metadata block cache: {cache}")
json.dump({
    "timestamp": os.path.basename(out).split("-")[0],
    "files": passes[0]["files"],
    "slice": int(slice_n),
    "inode_cache_mib": int(budget),
    "meta_cache_mib": int(meta),
    "bitmap_cache_mib": int(bitmap),
    "fixed_overhead_kib": fixed,
    "warmup": {"rss_kib": int(rss_w), "threads_kib": int(th_w), "inode_table_kib": int(table_w), "block_cache_kib": int(cache_w),
               "bitmap_cache_kib": int(bitmap_w)},
    "charged_kib": {k: dict(zip(("inode_table", "block_cache", "bitmap_cache"), c))
                    for k, c in zip(("after_pass1", "after_pass2", "after_forget"), charged)},
    "malloc_in_use_kib": dict(zip(("after_warmup", "after_pass1", "after_pass2", "after_forget"), [int(malloc_w)] + malloc)),
    "rss_budget_kib": [b for _, b, _ in checks],
    "rss_within_budget": ok,
    "slices_within_2x": worst >= 0.5,
    "threads_kib": {"after_warmup": int(th_w), "after_pass1": int(th1), "after_pass2": int(th2), "after_forget": int(th_f)},
    "threads": {"after_pass1": details[0], "after_pass2": details[1], "after_forget": details[2]},
    "passes": [p["rates"] for p in passes],
    "slowest_ratio": worst,
    "rss_kib": {"after_mount": int(rss0), "after_warmup": int(rss_w), "after_pass1": int(rss1), "after_pass2": int(rss2), "after_forget": int(rss_f),
                "pass1_end": int(end1), "pass2_end": int(end2)},
    "inode_table": table,
    "block_cache": cache,
    "host": {"kernel": platform.release(), "cpus": os.cpu_count()},
}, open(out, "w"), indent=2)
print(f"JSON: {out}")
PY
