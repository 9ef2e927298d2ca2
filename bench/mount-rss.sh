#!/bin/bash
# CetraFS mount memory and time against the volume's size (issue 9: memory that does not grow
# with the volume). For each size: mkfs a sparse file LUN (timed), mount one daemon on it
# (timed from the start of mount-cetra to its return, which waits for the daemon's readiness:
# superblock, heartbeat slot, journal replay, allocator and root directory loaded), read the
# daemon's VmRSS and VmHWM from /proc/<pid>/status, run `df` once (statfs goes through the
# allocator's free counts) and read them again, unmount (timed). Prints one row per size and
# the targets: RSS (VmHWM, the peak) <= 150 MiB at 8 TiB, mount < 3 s. Then, on the same
# LUN, two daemons take turns at a mkdir and a move between two directories they share
# (every move takes the global lock from the other node): the bytes each daemon read from
# the LUN per operation (/proc/<pid>/io) and the operations per second, which show what a
# grant of the global lock reads as the volume grows (the group records: docs/locking.md §9
# "How often the group records are read"). JSON to bench/results/<timestamp>-mount-rss.json.
#
# Usage: bench/mount-rss.sh
# Environment: RSS_SIZES (space-separated sizes in GiB, default "1024 8192"), TURNS (rounds
#   of the two nodes' turns, 4 operations each, default 50), BENCH_DIR
#   (default <repo>/.cache/bench; must hold sparse files of the largest size),
#   CETRA_BIN_DIR (default target/release; built if missing).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
case ${1:-} in
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "mount-rss: no arguments expected (see --help)" >&2; exit 1 ;;
esac
SIZES=${RSS_SIZES:-1024 8192}
BENCH_DIR=${BENCH_DIR:-$REPO/.cache/bench}
BIN_DIR=${CETRA_BIN_DIR:-$REPO/target/release}
RSS_TARGET_MIB=150
MOUNT_TARGET_MS=3000

die() { echo "mount-rss: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "run as root (FUSE mount)"
[[ -e /dev/fuse ]] || die "/dev/fuse is missing"
if [[ ! -x $BIN_DIR/mount-cetra || ! -x $BIN_DIR/mkfs-cetra ]]; then
    echo "mount-rss: building release binaries"
    (cd "$REPO" && cargo build --release --bins -q)
fi

mkdir -p "$BENCH_DIR" "$REPO/bench/results"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
WORK=$(mktemp -d "$BENCH_DIR/mount-rss-$STAMP-XXXX")
LUN=$WORK/lun.img
MNT=$WORK/mnt
MNT2=$WORK/mnt2
TURNS=${TURNS:-50}
mkdir -p "$MNT" "$MNT2"
MOUNTED=0
cleanup() {
    if ((MOUNTED)); then
        for m in "$MNT" "$MNT2"; do
            umount "$m" 2>/dev/null || fusermount3 -u "$m" 2>/dev/null || true
        done
    fi
    rm -f "$LUN" "$WORK/mount.log" "$WORK/mount2.log"
    rmdir "$MNT" "$MNT2" "$WORK" 2>/dev/null || true
}
trap cleanup EXIT

now_ms() { date +%s%3N; }
status_kib() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status"; }
read_bytes() { awk '$1 == "read_bytes:" {print $2}' "/proc/$1/io"; }
daemon_of() { pgrep -f "^$BIN_DIR/mount-cetra $LUN $1 " | head -1; }

# Two daemons on $LUN take turns ($TURNS rounds of a mkdir and a move between two shared
# directories on each); prints "<ms> <KiB read by node 1> <KiB read by node 2>".
turns() {
    CETRA_LOG_FILE=$WORK/mount.log "$BIN_DIR/mount-cetra" "$LUN" "$MNT" -o host=bench1
    MOUNTED=1
    CETRA_LOG_FILE=$WORK/mount2.log "$BIN_DIR/mount-cetra" "$LUN" "$MNT2" -o host=bench2
    local p1 p2 r1 r2 t0 t1 i
    p1=$(daemon_of "$MNT")
    p2=$(daemon_of "$MNT2")
    [[ -n $p1 && -n $p2 ]] || die "no mount-cetra daemons found for the turns"
    mkdir "$MNT/from" "$MNT/to"
    r1=$(read_bytes "$p1")
    r2=$(read_bytes "$p2")
    t0=$(now_ms)
    for ((i = 0; i < TURNS; i++)); do
        mkdir "$MNT/from/a$i" && mv "$MNT/from/a$i" "$MNT/to/"
        mkdir "$MNT2/from/b$i" && mv "$MNT2/from/b$i" "$MNT2/to/"
    done
    t1=$(now_ms)
    echo "$((t1 - t0)) $((($(read_bytes "$p1") - r1) >> 10)) $((($(read_bytes "$p2") - r2) >> 10))"
    umount "$MNT"
    umount "$MNT2"
    MOUNTED=0
    while kill -0 "$p1" 2>/dev/null || kill -0 "$p2" 2>/dev/null; do sleep 0.05; done
}

ROWS=()
JSON=()
FAIL=0
echo "mount-rss: sparse file LUNs on $(df --output=fstype "$WORK" | tail -1) ($WORK), binaries $BIN_DIR"
for gib in $SIZES; do
    rm -f "$LUN"
    truncate -s "${gib}G" "$LUN"
    t0=$(now_ms)
    "$BIN_DIR/mkfs-cetra" -q --force -L mount-rss "$LUN"
    mkfs_ms=$(($(now_ms) - t0))
    t0=$(now_ms)
    CETRA_LOG_FILE=$WORK/mount.log "$BIN_DIR/mount-cetra" "$LUN" "$MNT" -o host=bench
    mount_ms=$(($(now_ms) - t0))
    MOUNTED=1
    PID=$(pgrep -f "^$BIN_DIR/mount-cetra $LUN $MNT " | head -1)
    [[ -n $PID ]] || die "no mount-cetra daemon found for $MNT"
    rss=$(status_kib "$PID" VmRSS)
    hwm=$(status_kib "$PID" VmHWM)
    df -k "$MNT" >/dev/null
    rss_df=$(status_kib "$PID" VmRSS)
    hwm_df=$(status_kib "$PID" VmHWM)
    t0=$(now_ms)
    umount "$MNT"
    MOUNTED=0
    while kill -0 "$PID" 2>/dev/null; do sleep 0.05; done
    umount_ms=$(($(now_ms) - t0))
    read -r turns_ms kib1 kib2 < <(turns)
    ops=$((4 * TURNS))
    rm -f "$LUN"
    peak=$((hwm_df > hwm ? hwm_df : hwm))
    verdict=ok
    if ((gib >= 8192)) && ((peak > RSS_TARGET_MIB * 1024)); then verdict="RSS OVER"; FAIL=1; fi
    if ((mount_ms >= MOUNT_TARGET_MS)); then verdict="${verdict/ok/}${verdict:+ }MOUNT SLOW"; FAIL=1; fi
    ROWS+=("$(printf '%8s GiB %9d ms %9d ms %9d MiB %9d MiB %9d MiB %9d ms %9d ops/s %6d / %-6d  %s' \
        "$gib" "$mkfs_ms" "$mount_ms" $((rss >> 10)) $((rss_df >> 10)) $((peak >> 10)) "$umount_ms" \
        $((ops * 1000 / (turns_ms > 0 ? turns_ms : 1))) $((kib1 / ops)) $((kib2 / ops)) "$verdict")")
    JSON+=("{\"gib\":$gib,\"mkfs_ms\":$mkfs_ms,\"mount_ms\":$mount_ms,\"rss_kib\":$rss,\"rss_after_df_kib\":$rss_df,\"hwm_kib\":$peak,\"umount_ms\":$umount_ms,\"turn_ops\":$ops,\"turns_ms\":$turns_ms,\"turns_read_kib\":[$kib1,$kib2]}")
done

echo
printf '%12s %12s %12s %13s %13s %13s %12s %15s %17s\n' size mkfs mount "RSS mounted" "RSS after df" "peak (HWM)" umount turns "KiB read/op 1/2"
for r in "${ROWS[@]}"; do echo "$r"; done
echo "targets: peak RSS <= $RSS_TARGET_MIB MiB for 8 TiB; mount < $((MOUNT_TARGET_MS / 1000)) s"
OUT=$REPO/bench/results/$STAMP-mount-rss.json
(IFS=,; echo "{\"bench\":\"mount-rss\",\"rows\":[${JSON[*]}]}") >"$OUT"
echo "results: $OUT"
exit $FAIL
