#!/bin/bash
# CetraFS metadata benchmark: stat every file of a big tree, twice, with the kernel's caches
# dropped before each pass, on one node mounted with small cache budgets. Shows whether the
# per-file cost stays flat as the daemon's caches fill (issue 8: it used to fall 20x past
# 100,000 inodes) and whether the daemon's memory stays within its budget.
#
# Steps: make a volume on a sparse file LUN under $BENCH_DIR, mount it (one node,
# -o inode_cache=$STAT_BUDGET_MIB,meta_cache=$STAT_META_MIB), create DIRS x FILES empty files with mknod from 4 parallel
# python3 processes (timed), then twice: sync, `echo 3 > /proc/sys/vm/drop_caches`, and walk
# the tree in order (listdir + lstat of every file, as find or ls -l do), printing the rate of
# each SLICE-file slice and its ratio to the pass's first slice (the bar: every slice within 2x,
# i.e. ratio >= 0.5) and the daemon's RSS after the pass. After the second pass the kernel's
# caches are dropped once more (the kernel FORGETs every inode). The memory bar: the RSS
# after each pass within the daemon's budget, which is
#   RSS right after mount (code, libraries, the threads' first pages: the fixed baseline)
#   + inode_cache + meta_cache
#   + what the threads have touched since mount: their stacks (2 MiB mappings) and the FUSE
#     workers' request buffers (fuser reads every request into one 16 MiB buffer per worker;
#     the pages a request fills stay resident, so each worker holds as much as the largest
#     request it has received: a 1 MiB write, or a batch of FORGETs after drop_caches).
# The last term is read from /proc/PID/smaps by mapping size (2048 and 16392 KiB); a buffer
# whose mapping the kernel merged with a neighbour counts as cache memory instead. The
# caches' own accounts (their debug log lines) are shown too. The summary prints each
# criterion with PASS or MISS: the slowest slice's ratio, and the RSS after pass 2 with its
# budget and the margin (after pass 1 and after the final forget as context). The exit status
# is 0 unless the run itself broke. JSON to bench/results/<timestamp>-stat-tree.json.
#
# Usage: bench/stat-tree.sh
# Environment: STAT_DIRS (default 300), STAT_FILES (per directory, default 1000), STAT_SLICE
#   (default 20000), STAT_BUDGET_MIB (inode_cache=, default 16), STAT_META_MIB (meta_cache=,
#   default 16), BENCH_DIR (default
#   <repo>/.cache/bench), CETRA_BIN_DIR (default target/release; built if missing).
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
BUDGET_MIB=${STAT_BUDGET_MIB:-16}
META_MIB=${STAT_META_MIB:-16}
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
RUST_LOG=info,fuser::session=error,cetrafs_core::fs::inode_table=debug,cetrafs_core::fs::block_cache=debug \
    CETRA_LOG_FILE=$LOG "$BIN_DIR/mount-cetra" "$LUN" "$MNT" -o "host=bench,inode_cache=$BUDGET_MIB,meta_cache=$META_MIB"
MOUNTED=1
PID=$(pgrep -f "^$BIN_DIR/mount-cetra $LUN $MNT " | head -1)
[[ -n $PID ]] || die "no mount-cetra daemon found for $MNT"
echo "stat-tree: $DIRS x $FILES files on $(df --output=fstype "$WORK" | tail -1) ($LUN), inode_cache=$BUDGET_MIB MiB, meta_cache=$META_MIB MiB, daemon pid $PID"

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$PID/status"; }
# Resident KiB of the threads' stacks and the FUSE workers' request buffers (see the header).
threads_kib() {
    python3 - "/proc/$PID/smaps" <<'PY'
import re, sys
total, counted = 0, False
for line in open(sys.argv[1]):
    m = re.match(r"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(\S*)", line)
    if m:
        kib = (int(m[2], 16) - int(m[1], 16)) >> 10
        counted = not m[3] and kib in (2048, 16392)
    elif counted and line.startswith("Rss:"):
        total += int(line.split()[1])
print(total)
PY
}
RSS_MOUNTED=$(rss_kib)
THREADS_MOUNTED=$(threads_kib)
# The budget the RSS is held to: the baseline right after mount plus both caches' budgets
# plus what the threads touched since.
CACHES_KIB=$(((BUDGET_MIB + META_MIB) * 1024))
budget_kib() { echo $((RSS_MOUNTED + CACHES_KIB + $1 - THREADS_MOUNTED)); }
echo "  daemon RSS right after mount (the fixed baseline) $((RSS_MOUNTED >> 10)) MiB, of it threads' stacks and request buffers ${THREADS_MOUNTED} KiB; budget = baseline + inode_cache + meta_cache ($(((RSS_MOUNTED + CACHES_KIB) >> 10)) MiB) + the threads' growth"
# The caches' latest accounts (logged at debug level every 5 s when they changed).
table_line() { grep -h "inode table:" "$LOG" | tail -1 | sed 's/^.*inode table: //'; }
cache_line() { grep -h "metadata block cache:" "$LOG" | tail -1 | sed 's/^.*metadata block cache: //'; }
# within RSS_KIB THREADS_KIB
within() {
    local b
    b=$(budget_kib "$2")
    if (($1 <= b)); then echo "within the $b KiB budget by $((b - $1)) KiB"; else echo "OVER the $b KiB budget by $(($1 - b)) KiB"; fi
    echo "      (threads' stacks and request buffers $2 KiB, $(($2 - THREADS_MOUNTED)) KiB more than after mount)"
}
drop_caches() {
    sync
    echo 3 >/proc/sys/vm/drop_caches
    # FORGETs are sent asynchronously; let them arrive and the reporter (5 s) log and trim.
    sleep 7
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
declare -a RSS_AFTER=() THREADS_AFTER=()
for pass in 1 2; do
    drop_caches
    echo "  pass $pass: caches dropped, daemon RSS $(($(rss_kib) >> 10)) MiB; table: $(table_line)"
    python3 - "$MNT" "$SLICE" "$RESULTS/pass$pass.json" <<'PY'
import json, os, sys, time

mnt, slice_n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rates, n, t = [], 0, time.monotonic()
for d in sorted(os.listdir(mnt)):
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
    RSS_AFTER[pass]=$(rss_kib)
    THREADS_AFTER[pass]=$(threads_kib)
    sleep 6 # one report of the inode table
    echo "  pass $pass done: daemon RSS $((RSS_AFTER[pass] >> 10)) MiB, $(within "${RSS_AFTER[pass]}" "${THREADS_AFTER[pass]}") (the kernel still references every inode)"
    echo "    table: $(table_line)"
    echo "    block cache: $(cache_line)"
done
drop_caches
RSS_FORGOTTEN=$(rss_kib)
THREADS_FORGOTTEN=$(threads_kib)
TABLE=$(table_line)
CACHE=$(cache_line)
echo "  after dropping the caches again: daemon RSS $((RSS_FORGOTTEN >> 10)) MiB, $(within "$RSS_FORGOTTEN" "$THREADS_FORGOTTEN"); table: $TABLE"
umount "$MNT"
MOUNTED=0

OUT=$REPO/bench/results/$STAMP-stat-tree.json
python3 - "$RESULTS" "$OUT" "$SLICE" "$BUDGET_MIB" "$META_MIB" "$RSS_MOUNTED" "${RSS_AFTER[1]}" "${RSS_AFTER[2]}" "$RSS_FORGOTTEN" "$TABLE" "$CACHE" \
    "$THREADS_MOUNTED" "${THREADS_AFTER[1]}" "${THREADS_AFTER[2]}" "$THREADS_FORGOTTEN" <<'PY'
import json, os, platform, sys

res, out, slice_n, budget, meta, rss0, rss1, rss2, rss_f, table, cache, th0, th1, th2, th_f = sys.argv[1:]
fixed = int(rss0) + (int(budget) + int(meta)) * 1024
# Each measurement's budget: the fixed part plus what the threads touched since mount.
checks = [(int(r), fixed + int(t) - int(th0), int(t)) for r, t in ((rss1, th1), (rss2, th2), (rss_f, th_f))]
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
print(f"daemon RSS: {int(rss0)} KiB after mount, {int(rss1)} KiB after pass 1, {int(rss2)} KiB after pass 2, "
      f"{int(rss_f)} KiB after the kernel forgot the inodes")
mark = lambda ok: "PASS" if ok else "MISS"
print("\ncriteria (issue 8):")
print(f"  [{mark(worst >= 0.5)}] every {slice_n}-file slice within 2x of its pass's first slice: "
      f"slowest {worst:.2f} (bar: >= 0.50)")
for name, (r, b, t) in zip(("after pass 2", "after pass 1", "after the kernel forgot"), (checks[1], checks[0], checks[2])):
    what = "the criterion" if name == "after pass 2" else "context"
    print(f"  [{mark(r <= b)}] RSS {name} within the budget ({what}): RSS {r} KiB, budget {b} KiB "
          f"= {int(rss0)} after mount + {budget} MiB inode_cache + {meta} MiB meta_cache + {t - int(th0)} threads' growth; "
          f"margin {b - r} KiB")
ok = checks[1][0] <= checks[1][1]
print(f"inode table: {table}")
print(f"metadata block cache: {cache}")
json.dump({
    "timestamp": os.path.basename(out).split("-")[0],
    "files": passes[0]["files"],
    "slice": int(slice_n),
    "inode_cache_mib": int(budget),
    "meta_cache_mib": int(meta),
    "rss_budget_kib": [b for _, b, _ in checks],
    "rss_within_budget": ok,
    "slices_within_2x": worst >= 0.5,
    "threads_kib": {"after_mount": int(th0), "after_pass1": int(th1), "after_pass2": int(th2), "after_forget": int(th_f)},
    "passes": [p["rates"] for p in passes],
    "slowest_ratio": worst,
    "rss_kib": {"after_mount": int(rss0), "after_pass1": int(rss1), "after_pass2": int(rss2), "after_forget": int(rss_f)},
    "inode_table": table,
    "block_cache": cache,
    "host": {"kernel": platform.release(), "cpus": os.cpu_count()},
}, open(out, "w"), indent=2)
print(f"JSON: {out}")
PY
