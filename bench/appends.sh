#!/bin/bash
# CetraFS appends on several nodes (issue 9: a container's logs are appends, and small
# writes into a log's last block). Three daemons (host=node1..3) on one file LUN made with
# test timings. Each phase runs BENCH_SECONDS (default 5) of appends of 80-byte lines with
# O_APPEND, one write(2) per line, one writer per node, each into a log of its own in a
# directory of its own:
#   (a) node1 alone;
#   (b) node1 and node2 at once;
#   (c) node1 and node2 at once while node3 moves directories between two directories of
#       its own (each move takes the global lock).
# Prints appends/s, p99 and max latency per writer, node3's moves, and the ratios (b)/(a)
# and (c)/(a) per writer, all from one run; `fsck.cetra -n` at the end must be clean. JSON
# to bench/results/<timestamp>-appends.json (not committed).
#
# Usage: sudo bench/appends.sh
# Environment: BENCH_SECONDS, BENCH_DIR (default <repo>/.cache/bench), CETRA_BIN_DIR
#   (default target/release; built if missing).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
case ${1:-} in
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "appends: no arguments expected (see --help)" >&2; exit 1 ;;
esac
SECS=${BENCH_SECONDS:-5}
BENCH_DIR=${BENCH_DIR:-$REPO/.cache/bench}
BIN_DIR=${CETRA_BIN_DIR:-$REPO/target/release}

die() { echo "appends: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "run as root (FUSE mounts)"
[[ -e /dev/fuse ]] || die "/dev/fuse is missing"
command -v python3 >/dev/null || die "python3 is missing"
if [[ ! -x $BIN_DIR/mount-cetra || ! -x $BIN_DIR/mkfs-cetra ]]; then
    echo "appends: building release binaries"
    (cd "$REPO" && cargo build --release --bins -q)
fi

mkdir -p "$BENCH_DIR" "$REPO/bench/results"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
WORK=$(mktemp -d "$BENCH_DIR/appends-$STAMP-XXXX")
LUN=$WORK/lun.img
M=("" "$WORK/m1" "$WORK/m2" "$WORK/m3")
cleanup() {
    for i in 1 2 3; do
        if mountpoint -q "${M[i]}" 2>/dev/null; then
            umount "${M[i]}" 2>/dev/null || umount -l "${M[i]}" 2>/dev/null || true
        fi
    done
    rm -f "$LUN"
}
trap cleanup EXIT

truncate -s 4G "$LUN"
"$BIN_DIR/mkfs-cetra" --heartbeat-interval 100 --io-timeout 500 -N 4 "$LUN" >/dev/null 2>&1 ||
    die "mkfs failed"
for i in 1 2 3; do
    mkdir -p "${M[i]}"
    CETRA_LOG_FILE=$WORK/node$i.log "$BIN_DIR/mount-cetra" "$LUN" "${M[i]}" -o "host=node$i" ||
        die "mount of node$i failed (log: $WORK/node$i.log)"
    mkdir "${M[i]}/d$i"
done
mkdir "${M[3]}/d3/from" "${M[3]}/d3/to"

# One writer: appends for SECS seconds, then one JSON line of its numbers.
cat >"$WORK/append.py" <<'PY'
import json, os, sys, time
path, secs, tag = sys.argv[1], float(sys.argv[2]), sys.argv[3]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
lat, n = [], 0
end = time.monotonic() + secs
while time.monotonic() < end:
    t = time.perf_counter()
    os.write(fd, b"%08d a log line of eighty bytes, as a container writes them ...........\n" % n)
    lat.append(time.perf_counter() - t)
    n += 1
os.close(fd)
lat.sort()
print(json.dumps({"tag": tag, "ops_s": n / secs, "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
                  "max_ms": lat[-1] * 1e3}))
PY
append() { python3 "$WORK/append.py" "${M[$1]}/d$1/log" "$SECS" "$2"; }

echo "appends: 3 nodes on $LUN (binaries $BIN_DIR), $SECS s per phase"
RES=$WORK/results.jsonl
append 1 a-node1 >>"$RES"
append 1 b-node1 >>"$RES" &
append 2 b-node2 >>"$RES"
wait
(
    end=$((SECONDS + SECS + 1)) i=0
    while ((SECONDS < end)); do
        mkdir "${M[3]}/d3/from/x$i" && mv "${M[3]}/d3/from/x$i" "${M[3]}/d3/to/x$i"
        i=$((i + 1))
    done
    echo "{\"tag\": \"c-node3-moves\", \"ops_s\": $((i / (SECS + 1)))}" >>"$RES"
) &
mover=$!
append 1 c-node1 >>"$RES" &
append 2 c-node2 >>"$RES"
wait
wait "$mover" 2>/dev/null || true

for i in 1 2 3; do umount "${M[i]}"; done
sleep 2
FSCK=$("$BIN_DIR/fsck-cetra" -n "$LUN" 2>&1 | tail -1)

python3 - "$RES" "$REPO/bench/results/$STAMP-appends.json" "$FSCK" "$(git -C "$REPO" rev-parse --short HEAD)" <<'PY'
import json, sys
rows = {r["tag"]: r for r in map(json.loads, open(sys.argv[1]))}
a = rows["a-node1"]["ops_s"]
print(f"{'phase':44} {'appends/s':>10} {'p99 ms':>8} {'max ms':>8} {'/ (a)':>6}")
for tag, what in [("a-node1", "(a) node1 alone"), ("b-node1", "(b) node1, with node2"),
                  ("b-node2", "(b) node2, with node1"), ("c-node1", "(c) node1, node2 + node3 moving dirs"),
                  ("c-node2", "(c) node2, node1 + node3 moving dirs")]:
    r = rows[tag]
    print(f"{what:44} {r['ops_s']:10.0f} {r['p99_ms']:8.2f} {r['max_ms']:8.1f} {r['ops_s'] / a:6.2f}")
print(f"(c) node3 moved {rows['c-node3-moves']['ops_s']} directories/s meanwhile")
print(f"fsck: {sys.argv[3]}")
json.dump({"commit": sys.argv[4], "rows": rows, "fsck": sys.argv[3]}, open(sys.argv[2], "w"), indent=1)
PY
[[ $FSCK == *clean* ]] || die "fsck is not clean: $FSCK"
