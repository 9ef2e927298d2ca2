#!/bin/bash
# CetraFS cluster benchmark (issue 9): three nodes (mount-cetra daemons host=node1..3, one
# mountpoint each) on one volume on a LUN file (written full first: BENCH_LUN), measuring in
# ONE run what stops nodes from working side by side, and printing a table with the ratios
# computed here, each line marked PASS/MISS against issue 9's target. The exit status is 0
# unless the run itself broke (a MISS is a result, not a failure).
#
#   1. fio randwrite 4k QD32 (libaio, direct=1) into a FRESH sparse image (made with truncate,
#      never written: a thin VM disk) vs the same job on a PREFILLED image; 1 node, then 3 nodes
#      at once (each its own image). Target: fresh/prefilled >= 0.8.
#   2. nodes 2+3 randread 4k QD32 on their own prefilled images while node 1 is (a) idle,
#      (b) randwrites a fresh thin image, (c) creates files in a loop. Targets: (b), (c) IOPS
#      >= 0.9x (a) and p99 <= 1.3x (a). Then (with 2 CPUs or more) all three again with node
#      1's daemon and processes on CPU 0 and nodes 2+3's on CPU 1 (taskset), as if node 1 were
#      another host: unpinned, the three nodes share this machine's CPUs and (b) measures
#      mostly the CPU node 1's writer takes from the readers; pinned, what reaches the readers
#      through the LUN and the locks. Both are reported against the targets. For context, no
#      target: (d) node 1 randwrites its prefilled image (no metadata, no locks): what a writer
#      at full speed costs the readers through the shared CPUs and LUN alone.
#   3. create+rename+unlink ops/s (bench/cluster.py meta: create, rename in the same directory,
#      unlink, each one op): 1 node alone; 3 nodes each in a private directory; 3 nodes in one
#      shared directory. Targets: private aggregate >= 1.5x one node; shared >= 1000 ops/s and
#      >= 0.8x one node.
#   4. one inode's lock bounced between node1 and node2: the same file changed alternately
#      through the two mountpoints by futimens on a descriptor open on each node; per-op
#      handoff latency p50/p99. Target: p99 < 20 ms. For context also open + 1-byte
#      pwrite + fsync + close in turns (a file open for writing on one node cannot be opened
#      for writing on another, so each turn includes the open registration).
#   5. node 1 SIGKILLed while growing a thin image (fio randwrite on a fresh image) while nodes
#      2+3 randread their prefilled images logging IOPS once a second (fio --write_iops_log,
#      log_avg_msec=1000): seconds with zero completions and the longest run of them. Target:
#      none. Runs last: node 1 stays dead.
# For context it also runs the fio jobs on raw sparse LUN files of the same kind (fresh and
# prefilled randwrite, 1 and 3 processes on disjoint regions; randread from 2 processes, idle
# and while a third randwrites a fresh sparse file: the raw context of 2(b)), and
# reports each daemon's CPU (utime+stime from /proc) per phase.
#
# The volume is made with SHORT TEST TIMINGS (mkfs --heartbeat-interval 100 --io-timeout 500:
# dead time 5.2 s instead of 84 s) so that section 5 finishes in seconds; the output says so.
# A full run takes about 5 minutes with the defaults, plus deleting the LUN files at the end.
#
# Usage: sudo bench/cluster.sh
# Environment: BENCH_RUNTIME (seconds per fio job, default 8, plus fio's 2 s ramp), BENCH_SIZE
#   (every image, fresh and prefilled, default 2G; the LUN file is 9 images + 2 GiB),
#   BENCH_LUN (written: the LUN file is written full before mkfs, as a SAN LUN has every block
#   already, so that a fresh image's first writes do not also pay the host filesystem's own
#   allocation; sparse: left sparse, as before 2026-12-01; default written),
#   BENCH_META_SECONDS (per section-3 run, default BENCH_RUNTIME), BENCH_BOUNCES (handoffs per
#   section-4 variant, default 200), BENCH_KILL_AT (seconds into the section-5 reads when node 1
#   is killed, default 4), BENCH_KILL_RUNTIME (section-5 reads, default 20), BENCH_SECTIONS
#   (subset of "1 2 3 4 5"; the raw baseline runs with 1 or 2), BENCH_DIR (default
#   <repo>/.cache/bench), CETRA_BIN_DIR (default target/release; built if missing).
# Results: bench/results/<timestamp>-cluster.json (generated, not committed); the run's fio
#   JSON, IOPS logs and daemon logs stay in $BENCH_DIR/cluster-<timestamp>-*/.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
case ${1:-} in
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "cluster: no arguments expected (see --help)" >&2; exit 1 ;;
esac
RUNTIME=${BENCH_RUNTIME:-8}
SIZE=${BENCH_SIZE:-2G}
META_SECONDS=${BENCH_META_SECONDS:-$RUNTIME}
BOUNCES=${BENCH_BOUNCES:-200}
KILL_AT=${BENCH_KILL_AT:-4}
KILL_RUNTIME=${BENCH_KILL_RUNTIME:-20}
SECTIONS=" ${BENCH_SECTIONS:-1 2 3 4 5} "
LUN_MODE=${BENCH_LUN:-written}
[[ $LUN_MODE == written || $LUN_MODE == sparse ]] || { echo "cluster: BENCH_LUN must be written or sparse" >&2; exit 1; }
BENCH_DIR=${BENCH_DIR:-$REPO/.cache/bench}
BIN_DIR=$(realpath -m "${CETRA_BIN_DIR:-$REPO/target/release}")
PY=$REPO/bench/cluster.py
FIO=$REPO/bench/fio
HB_MS=100
IO_TIMEOUT_MS=500

die() { echo "cluster: $*" >&2; exit 1; }
want() { [[ $SECTIONS == *" $1 "* ]]; }
[[ $(id -u) -eq 0 ]] || die "run as root (FUSE mounts)"
command -v fio >/dev/null || { echo "cluster: installing fio"; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio >/dev/null; }
command -v python3 >/dev/null || die "python3 is needed"
[[ -e /dev/fuse ]] || die "/dev/fuse is missing"
for v in RUNTIME META_SECONDS BOUNCES KILL_AT KILL_RUNTIME; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "BENCH_$v must be a positive whole number, not '${!v}'"
done
((KILL_AT < KILL_RUNTIME)) || die "BENCH_KILL_AT must be less than BENCH_KILL_RUNTIME"

to_bytes() {
    local v=${1^^}
    case $v in
        *K) echo $((${v%K} << 10)) ;;
        *M) echo $((${v%M} << 20)) ;;
        *G) echo $((${v%G} << 30)) ;;
        *) [[ $v =~ ^[0-9]+$ ]] && echo "$v" || die "BENCH_SIZE: not a size: $1" ;;
    esac
}
SIZE_B=$(to_bytes "$SIZE")
((SIZE_B >= 64 << 20)) || die "BENCH_SIZE must be at least 64M"

if [[ ! -x $BIN_DIR/mount-cetra || ! -x $BIN_DIR/mkfs-cetra ]]; then
    echo "cluster: building release binaries"
    (cd "$REPO" && cargo build --release --bins -q)
fi

mkdir -p "$BENCH_DIR" "$REPO/bench/results"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
WORK=$(mktemp -d "$BENCH_DIR/cluster-$STAMP-XXXX")
RES=$WORK/results
mkdir -p "$RES"
LUN=$WORK/cetra-lun.img
declare -a M=() PIDS=() BG=()
for i in 1 2 3; do M[i]=$WORK/mnt-node$i; done

# ---- cleanup: every process and mount this run started, even on failure --------------------
is_mounted() { awk -v m="$1" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo; }
cleanup() {
    local rc=$? p i t
    set +e
    for p in "${BG[@]}"; do kill "$p" 2>/dev/null; done
    for i in 1 2 3; do
        is_mounted "${M[i]}" || continue
        umount "${M[i]}" 2>/dev/null || umount -l "${M[i]}" 2>/dev/null || fusermount3 -uz "${M[i]}" 2>/dev/null
    done
    for i in 1 2 3; do
        p=${PIDS[i]:-}
        [[ -n $p ]] || continue
        for ((t = 0; t < 300; t++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$p" 2>/dev/null; then
            echo "cluster: daemon $p (node$i) still running 30 s after its unmount; killing it" >&2
            kill -KILL "$p"
        fi
    done
    if compgen -G "$WORK/*.img" >/dev/null; then
        echo "cluster: removing this run's LUN and image files (slow if the host filesystem discards)"
        rm -f "$WORK"/*.img
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- helpers -----------------------------------------------------------------------------------
# fio in the background: name node file offset jobfile [VAR=value...]; JSON+ to $RES/name.nodeN.json.
fio_bg() {
    local name=$1 node=$2 file=$3 off=$4 job=$5
    shift 5
    env FILENAME="$file" SIZE="$SIZE_B" OFFSET="$off" RUNTIME="$RUNTIME" "$@" \
        timeout -k 10 $((RUNTIME + KILL_RUNTIME + 120)) $(pin_cmd "$node") \
        fio --output-format=json+ --output="$RES/$name.node$node.json" "$FIO/$job" >/dev/null 2>"$RES/$name.node$node.err" &
    LAST=$!
    BG+=("$LAST")
}
wait_ok() { # pid... : every one must exit 0
    local p rc=0
    for p in "$@"; do wait "$p" || rc=$?; done
    ((rc == 0)) || { tail -n 5 "$RES"/*.err >&2 2>/dev/null; die "a benchmark process failed (exit $rc); output in $RES"; }
}
prefill() { # file size
    local t0=$SECONDS
    FILENAME=$1 SIZE=$2 OFFSET=0 fio --output-format=terse "$FIO/prefill.fio" >/dev/null || die "prefill of $1 failed"
    echo "  prefilled $(($2 >> 20)) MiB of $1 in $((SECONDS - t0)) s"
}
alloc_note() { # name file: note how much a fresh image allocated, then delete it (with the
    # default 1 MiB granule a fresh image ends its job fully allocated, and the LUN holds only
    # 9 images + 2 GiB)
    local b
    b=$(stat -c '%b %B' "$2" | awk '{print int($1 * $2 / 1048576)}')
    echo "$1: $b MiB allocated of $((SIZE_B >> 20)) MiB" >>"$RES/fresh-alloc.txt"
    rm -f "$2"
}
# Daemon CPU per phase: cpu_begin, then cpu_end "phase text".
CLK=$(getconf CLK_TCK)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
cpu_begin() {
    local i
    CPU_T0=$(date +%s.%N)
    for i in 1 2 3; do CPU0[i]=$([[ -n ${PIDS[i]:-} ]] && ticks "${PIDS[i]}" || echo 0); done
}
cpu_end() {
    local i line t1 now
    t1=$(date +%s.%N)
    line=$(printf '%-48s' "$1:")
    for i in 1 2 3; do
        if [[ -n ${PIDS[i]:-} ]] && kill -0 "${PIDS[i]}" 2>/dev/null; then
            now=$(ticks "${PIDS[i]}")
            line+=$(awk -v a="${CPU0[i]}" -v b="$now" -v t0="$CPU_T0" -v t1="$t1" -v hz="$CLK" -v n="$i" \
                'BEGIN { printf "  node%d %5.1f%%", n, (b - a) / hz / (t1 - t0) * 100 }')
        else
            line+="  node$i   dead"
        fi
    done
    echo "$line" >>"$RES/cpu.txt"
}
declare -a CPU0=()
mount_node() {
    local i=$1
    mkdir -p "${M[i]}"
    CETRA_LOG_FILE=$WORK/node$i.log "$BIN_DIR/mount-cetra" "$LUN" "${M[i]}" -o "host=node$i${BENCH_MOUNT_OPTS:+,$BENCH_MOUNT_OPTS}" ||
        die "mount of node$i failed; log: $WORK/node$i.log"
    PIDS[i]=$(pgrep -f "mount[.-]cetra $LUN ${M[i]}( |$)" | head -1)
    [[ -n ${PIDS[i]} ]] || die "no daemon found for ${M[i]}"
}
# Section 2 also runs with node 1 on CPU 0 and nodes 2+3 on CPU 1 (daemons and their fio):
# PIN[node] is the CPU list of that node's processes, empty when not pinned.
declare -a PIN=()
pin_cmd() { [[ -z ${PIN[$1]:-} ]] || echo "taskset -c ${PIN[$1]}"; }
pin_daemons() { # every thread of each live daemon to PIN[node], or to every CPU
    local i
    for i in 1 2 3; do
        [[ -n ${PIDS[i]:-} ]] || continue
        taskset -a -p -c "${PIN[i]:-0-$(($(nproc) - 1))}" "${PIDS[i]}" >/dev/null || die "taskset of node$i failed"
    done
}
wait_visible() { # path : up to 10 s (another node's entry and attribute caches)
    local t
    for ((t = 0; t < 100; t++)); do [[ -e $1 ]] && return 0; sleep 0.1; done
    die "$1 did not appear"
}
meta_bg() { # name node dir seconds mode start
    timeout -k 5 $(($4 + 120)) $(pin_cmd "$2") python3 "$PY" meta --dir "$3" --seconds "$4" --mode "$5" --start "$6" \
        --tag "node$2" --out "$RES/$1.node$2.json" &
    LAST=$!
    BG+=("$LAST")
}
start_at() { python3 -c 'import time; print(f"{time.time() + 1.5:.3f}")'; }

LUN_B=$((9 * SIZE_B + (2 << 30)))
LUN_KIND="$LUN_MODE file on $(df --output=fstype "$WORK" | tail -1) ($WORK)"
TIMINGS="mkfs-cetra --heartbeat-interval $HB_MS --io-timeout $IO_TIMEOUT_MS (short test timings: dead time 5.2 s; production defaults 2000/8000 ms give 84 s)"
COMMIT=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
[[ -z $(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null) ]] || COMMIT+="+dirty"
python3 - "$RES/run.json" <<PY
import json, os, sys
json.dump({"stamp": "$STAMP", "commit": "$COMMIT", "cpus": os.cpu_count(),
           "load": open("/proc/loadavg").read().split()[0], "runtime": $RUNTIME, "size": "$SIZE",
           "meta_seconds": $META_SECONDS, "bounces": $BOUNCES, "lun_kind": "$LUN_KIND",
           "timings": "$TIMINGS", "sections": "$SECTIONS".split()}, open(sys.argv[1], "w"))
PY
echo "cluster: $LUN_KIND; images $SIZE; ${RUNTIME} s per fio job (+2 s ramp); commit $COMMIT; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "cluster: volume timings: $TIMINGS"

# ---- raw LUN baseline --------------------------------------------------------------------------
if want 1 || want 2; then
    echo "raw LUN baseline (sparse files under $WORK):"
    RAW_PRE=$WORK/raw-prefilled.img
    RAW_F1=$WORK/raw-fresh1.img
    RAW_F3=$WORK/raw-fresh3.img
    truncate -s $((3 * SIZE_B)) "$RAW_PRE" "$RAW_F3"
    truncate -s "$SIZE_B" "$RAW_F1"
    prefill "$RAW_PRE" $((3 * SIZE_B))
    if want 1; then
        echo "  randwrite: fresh sparse file, 1 process"
        fio_bg raw-fresh1 1 "$RAW_F1" 0 cluster-randwrite-4k-qd32.fio; wait_ok "$LAST"
        echo "  randwrite: prefilled file, 1 process"
        fio_bg raw-pre1 1 "$RAW_PRE" 0 cluster-randwrite-4k-qd32.fio; wait_ok "$LAST"
        echo "  randwrite: fresh sparse file, 3 processes on disjoint regions"
        p=()
        for i in 1 2 3; do fio_bg raw-fresh3 "$i" "$RAW_F3" $(((i - 1) * SIZE_B)) cluster-randwrite-4k-qd32.fio; p+=("$LAST"); done
        wait_ok "${p[@]}"
        echo "  randwrite: prefilled file, 3 processes on disjoint regions"
        p=()
        for i in 1 2 3; do fio_bg raw-pre3 "$i" "$RAW_PRE" $(((i - 1) * SIZE_B)) cluster-randwrite-4k-qd32.fio; p+=("$LAST"); done
        wait_ok "${p[@]}"
    fi
    if want 2; then
        echo "  randread QD32: prefilled file, 2 processes (regions 2 and 3)"
        p=()
        for i in 2 3; do fio_bg raw-read2 "$i" "$RAW_PRE" $(((i - 1) * SIZE_B)) rand-read-4k-qd32.fio; p+=("$LAST"); done
        wait_ok "${p[@]}"
        # Context for 2(b), no target: the same readers while a third process randwrites a
        # fresh sparse file, as node 1 does in 2(b) but with no daemon: what a writer at full
        # speed costs two readers on this machine's CPUs and disk alone.
        echo "  randread QD32, 2 processes, while a third randwrites a fresh sparse file"
        RAW_FB=$WORK/raw-fresh-b.img
        truncate -s "$SIZE_B" "$RAW_FB"
        RUNTIME=$((RUNTIME + 6)) fio_bg raw-write-bg 1 "$RAW_FB" 0 cluster-randwrite-4k-qd32.fio
        bg=$LAST
        sleep 2
        p=()
        for i in 2 3; do fio_bg raw-read2-b "$i" "$RAW_PRE" $(((i - 1) * SIZE_B)) rand-read-4k-qd32.fio; p+=("$LAST"); done
        wait_ok "${p[@]}" "$bg"
    fi
    # Kept until the exit: deleting written files can take minutes on a host filesystem mounted
    # with online discard, and would stall the measurements that follow.
fi

# ---- CetraFS: one volume, three nodes ------------------------------------------------------------
truncate -s "$LUN_B" "$LUN"
[[ $LUN_MODE == sparse ]] || prefill "$LUN" "$LUN_B"
"$BIN_DIR/mkfs-cetra" -q --force -L cluster --heartbeat-interval "$HB_MS" --io-timeout "$IO_TIMEOUT_MS" "$LUN"
for i in 1 2 3; do mount_node "$i"; done
echo "[+$((SECONDS))s] CetraFS on $LUN ($((LUN_B >> 30)) GiB, $LUN_MODE): node1..3 daemons ${PIDS[1]} ${PIDS[2]} ${PIDS[3]}"
PRE=()
if want 1 || want 2 || want 5; then
    for i in 1 2 3; do
        PRE[i]=${M[i]}/vm-10$i-disk-0.raw
        prefill "${PRE[i]}" "$SIZE_B"
    done
fi
fresh() { # node name: a new thin image (never written) on that node
    local f=${M[$1]}/$2.raw
    truncate -s "$SIZE_B" "$f"
    echo "$f"
}

if want 1; then
    echo "[+$((SECONDS))s] 1. randwrite 4k QD32, fresh thin image vs prefilled"
    F=$(fresh 1 fresh-1node)
    cpu_begin
    fio_bg c-fresh1 1 "$F" 0 cluster-randwrite-4k-qd32.fio; wait_ok "$LAST"
    cpu_end "1 fresh randwrite, node1"
    alloc_note "c-fresh1 node1" "$F"
    cpu_begin
    fio_bg c-pre1 1 "${PRE[1]}" 0 cluster-randwrite-4k-qd32.fio; wait_ok "$LAST"
    cpu_end "1 prefilled randwrite, node1"
    p=()
    cpu_begin
    for i in 1 2 3; do F3[i]=$(fresh "$i" "fresh-3nodes-node$i"); done
    for i in 1 2 3; do fio_bg c-fresh3 "$i" "${F3[i]}" 0 cluster-randwrite-4k-qd32.fio; p+=("$LAST"); done
    wait_ok "${p[@]}"
    cpu_end "1 fresh randwrite, 3 nodes"
    for i in 1 2 3; do alloc_note "c-fresh3 node$i" "${F3[i]}"; done
    p=()
    cpu_begin
    for i in 1 2 3; do fio_bg c-pre3 "$i" "${PRE[i]}" 0 cluster-randwrite-4k-qd32.fio; p+=("$LAST"); done
    wait_ok "${p[@]}"
    cpu_end "1 prefilled randwrite, 3 nodes"
fi

readers() { # name : nodes 2+3 randread QD32 on their prefilled images, waited for
    local i p=()
    for i in 2 3; do fio_bg "$1" "$i" "${PRE[i]}" 0 rand-read-4k-qd32.fio; p+=("$LAST"); done
    wait_ok "${p[@]}"
}
loaded_readers() { # name phase: nodes 2+3 read while node 1's load ($LAST, just started in the
    # background, running RUNTIME + 6 s) goes on: it starts 2 s before the readers and outlasts
    # them (their 2 s ramp + runtime)
    local bg=$LAST
    sleep 2
    cpu_begin
    readers "$1"
    cpu_end "$2"
    wait_ok "$bg"
}
section2() { # prefix label
    local p=$1
    echo "[+$((SECONDS))s] 2$2. nodes 2+3 randread QD32 while node 1 is (a) idle, (b) randwrites a fresh thin image, (c) creates files"
    cpu_begin
    readers "$p-idle"
    cpu_end "2a$2 readers, node1 idle"
    F=$(fresh 1 "fresh-$p")
    RUNTIME=$((RUNTIME + 6)) fio_bg "$p-write-bg" 1 "$F" 0 cluster-randwrite-4k-qd32.fio
    loaded_readers "$p-write" "2b$2 readers, node1 randwrites fresh"
    alloc_note "$p-write-bg node1" "$F"
    meta_bg "$p-create-bg" 1 "${M[1]}/$p-creates" $((RUNTIME + 6)) create 0
    loaded_readers "$p-create" "2c$2 readers, node1 creates"
    # Context, no target: (d) node 1 randwrites its PREFILLED image, no metadata and no lock
    # traffic at all: what a writer at full speed costs the readers through this machine's
    # CPUs and the LUN alone, to read (b) against.
    RUNTIME=$((RUNTIME + 6)) fio_bg "$p-over-bg" 1 "${PRE[1]}" 0 cluster-randwrite-4k-qd32.fio
    loaded_readers "$p-over" "2d$2 readers, node1 overwrites prefilled"
}
if want 2; then
    section2 s2 ""
    # The same as if node 1 were another host: on this machine the nodes share its CPUs, and
    # (b) then measures mostly how much CPU node 1's writer takes from the readers.
    if (($(nproc) >= 2)); then
        PIN=([1]=0 [2]=1 [3]=1)
        pin_daemons
        echo "[+$((SECONDS))s] 2 again, pinned: node1's daemon and processes on CPU 0, nodes 2+3's on CPU 1"
        section2 s2p " pinned"
        PIN=()
        pin_daemons
    fi
fi

if want 3; then
    echo "[+$((SECONDS))s] 3. create+rename+unlink, ${META_SECONDS} s each: 1 node; 3 nodes private dirs; 3 nodes one shared dir"
    cpu_begin
    meta_bg s3-one 1 "${M[1]}/s3-one" "$META_SECONDS" cru "$(start_at)"; wait_ok "$LAST"
    cpu_end "3 meta ops, node1 alone"
    p=()
    S=$(start_at)
    cpu_begin
    for i in 1 2 3; do meta_bg s3-private "$i" "${M[i]}/s3-private-node$i" "$META_SECONDS" cru "$S"; p+=("$LAST"); done
    wait_ok "${p[@]}"
    cpu_end "3 meta ops, 3 nodes private dirs"
    mkdir "${M[1]}/s3-shared"
    for i in 2 3; do wait_visible "${M[i]}/s3-shared"; done
    p=()
    S=$(start_at)
    cpu_begin
    for i in 1 2 3; do meta_bg s3-shared "$i" "${M[i]}/s3-shared" "$META_SECONDS" cru "$S"; p+=("$LAST"); done
    wait_ok "${p[@]}"
    cpu_end "3 meta ops, 3 nodes shared dir"
fi

if want 4; then
    echo "[+$((SECONDS))s] 4. one inode bounced between node1 and node2, $BOUNCES handoffs each: futimens; open+pwrite+fsync+close"
    head -c 4096 /dev/zero >"${M[1]}/bounce"
    wait_visible "${M[2]}/bounce"
    for mode in utime write; do
        cpu_begin
        timeout -k 5 $((BOUNCES + 120)) python3 "$PY" bounce --a "${M[1]}/bounce" --b "${M[2]}/bounce" \
            --count "$BOUNCES" --mode "$mode" --out "$RES/s4-$mode.json" || die "bounce ($mode) failed"
        cpu_end "4 lock bounce ($mode)"
    done
fi

if want 5; then
    echo "[+$((SECONDS))s] 5. node1 SIGKILLed ${KILL_AT} s into ${KILL_RUNTIME} s of randread on nodes 2+3, while it grows a thin image"
    F=$(fresh 1 fresh-s5)
    RUNTIME=$((KILL_RUNTIME + 30)) fio_bg s5-writer 1 "$F" 0 cluster-randwrite-4k-qd32.fio
    W=$LAST
    sleep 2
    p=()
    cpu_begin
    T0=$(date +%s.%N)
    for i in 2 3; do
        RUNTIME=$KILL_RUNTIME fio_bg s5 "$i" "${PRE[i]}" 0 cluster-randread-4k-qd32-log.fio IOPS_LOG="$RES/s5.node$i"
        p+=("$LAST")
    done
    sleep "$KILL_AT"
    kill -KILL "${PIDS[1]}"
    TK=$(date +%s.%N)
    echo "  killed node1's daemon ${PIDS[1]}"
    wait_ok "${p[@]}"
    cpu_end "5 readers, node1 killed"
    # node 1's fio loses its mount: it exits with an error (expected), or is stopped here.
    for ((t = 0; t < 100; t++)); do kill -0 "$W" 2>/dev/null || break; sleep 0.1; done
    kill "$W" 2>/dev/null || true
    wait "$W" 2>/dev/null || true
    umount -l "${M[1]}" 2>/dev/null || fusermount3 -uz "${M[1]}" 2>/dev/null || true
    PIDS[1]=
    python3 - "$RES/s5.json" "$T0" "$TK" "$KILL_RUNTIME" "$WORK/node2.log" "$WORK/node3.log" <<'PY'
import json, re, sys
out, t0, tk, rt, *logs = sys.argv[1:]
lines = []
for lg in logs:
    for line in open(lg, errors="replace"):
        if re.search(r"recover", line, re.I):
            lines.append(f"{lg.rsplit('/', 1)[-1]}: {line.strip()[:200]}")
json.dump({"kill_at_s": float(tk) - float(t0), "runtime_s": int(rt), "recovery_log": lines[:8]},
          open(out, "w"))
PY
fi

OUT=$REPO/bench/results/$STAMP-cluster.json
python3 "$PY" report "$RES" "$OUT"
