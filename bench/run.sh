#!/bin/bash
# CetraFS storage benchmark: the six workloads of the public Proxmox storage benchmark, run
# first against the raw LUN and then against fully written image files on CetraFS mounts of
# the same kind of LUN, once per FUSE transport (classic /dev/fuse, and FUSE over io_uring
# when the kernel has it), all in one run. Prints a table per transport (IOPS, p50/p99
# latency, ratio CetraFS/raw, CPU per 1,000 I/Os) and uring against classic, and writes
# bench/results/<timestamp>[-<N>nodes].json.
#
# Usage: bench/run.sh [--nodes N] [BLOCK_DEVICE]
#   no argument: both LUNs are sparse files under $BENCH_DIR (default <repo>/.cache/bench),
#                on the same filesystem, of the same size, and both written in full before
#                anything reads them (a LUN file with holes reads faster than one without).
#   BLOCK_DEVICE: raw runs against the device, then it is formatted (DESTROYS ITS DATA; set
#                BENCH_DESTROY=1 to confirm) and mounted for the CetraFS runs.
#   --nodes N: N nodes on one LUN, all N at once for every workload: raw: N fio processes on
#                the raw LUN, each on its own disjoint region (offset = i x image size);
#                CetraFS: one freshly made volume mounted by N mount-cetra daemons
#                (host=node1..N, one mountpoint each), each fio process on its own prefilled
#                image in its own mountpoint. Reports per workload the aggregate IOPS (sum of
#                the N) and p50/p99 from the merged latency histograms.
# CPU per 1,000 I/Os: user+system time of the mount-cetra daemons (from /proc/<pid>/stat,
#   over the whole fio run including its 2 s ramp, divided by IOPS x that time), and of the
#   fio processes themselves (fio's usr/sys, which for the raw LUN is the whole I/O path).
# Transports: classic (transport=classic) and uring (transport=uring, with the fuse module's
#   enable_uring set to 1 for the run and restored afterwards); BENCH_TRANSPORTS overrides
#   (e.g. "uring"). Without /sys/module/fuse/parameters/enable_uring only classic runs.
# Environment: BENCH_RUNTIME (seconds per workload, default 15; 10 with --nodes), BENCH_SIZE
#   (image size, per node with --nodes; default 4G, 2G with --nodes), BENCH_DIR, BENCH_ONLY
#   (space-separated subset of workload names), CETRA_BIN_DIR (default target/release; built
#   if missing).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NODES=1
ARGS=()
while (($#)); do
    case $1 in
        --nodes) NODES=${2:-}; shift 2 || { echo "bench: --nodes needs a number" >&2; exit 1; } ;;
        --nodes=*) NODES=${1#*=}; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "bench: unknown option $1" >&2; exit 1 ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
[[ $NODES =~ ^[1-9][0-9]*$ ]] || { echo "bench: --nodes needs a positive number, not '$NODES'" >&2; exit 1; }
set -- "${ARGS[@]}"
# The raw LUN and the one CetraFS is made on: the same block device (destroyed), or two sparse
# files side by side, of the same size.
pick_luns() {
    if [[ -n $DEVICE ]]; then
        [[ -b $DEVICE ]] || die "$DEVICE is not a block device"
        [[ ${BENCH_DESTROY:-0} == 1 ]] || die "benchmarking $DEVICE destroys its data; set BENCH_DESTROY=1"
        RAW=$DEVICE
        CETRA_LUN=$DEVICE
        RAW_KIND="block device $DEVICE"
    else
        RAW=$WORK/raw-lun.img
        CETRA_LUN=$WORK/cetra-lun.img
        truncate -s "$LUN_B" "$RAW" "$CETRA_LUN"
        RAW_KIND="file on $(df --output=fstype "$WORK" | tail -1) ($WORK), written in full"
    fi
}

if ((NODES > 1)); then
    RUNTIME=${BENCH_RUNTIME:-10}
    SIZE=${BENCH_SIZE:-2G}
else
    RUNTIME=${BENCH_RUNTIME:-15}
    SIZE=${BENCH_SIZE:-4G}
fi
BENCH_DIR=${BENCH_DIR:-$REPO/.cache/bench}
BIN_DIR=${CETRA_BIN_DIR:-$REPO/target/release}
WORKLOADS=(seq-read-1m-qd16 seq-write-1m-qd16 rand-read-4k-qd32 rand-write-4k-qd32 rand-rw7030-4k-qd32 rand-read-4k-qd1)
[[ -n ${BENCH_ONLY:-} ]] && read -r -a WORKLOADS <<<"$BENCH_ONLY"
DEVICE=${1:-}

die() { echo "bench: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "run as root (FUSE mount, O_DIRECT on devices)"
command -v fio >/dev/null || { echo "bench: installing fio"; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio >/dev/null; }
command -v python3 >/dev/null || die "python3 is needed to summarize fio's JSON"
[[ -e /dev/fuse ]] || die "/dev/fuse is missing"

to_bytes() {
    local v=${1^^}
    case $v in
        *K) echo $((${v%K} << 10)) ;;
        *M) echo $((${v%M} << 20)) ;;
        *G) echo $((${v%G} << 30)) ;;
        *T) echo $((${v%T} << 40)) ;;
        *) echo "$v" ;;
    esac
}
SIZE_B=$(to_bytes "$SIZE")
# The CetraFS LUN holds the image(s) plus journals (16 x 64 MiB by default) and metadata.
LUN_B=$((NODES * SIZE_B + (2 << 30)))

if [[ ! -x $BIN_DIR/mount-cetra || ! -x $BIN_DIR/mkfs-cetra ]]; then
    echo "bench: building release binaries"
    (cd "$REPO" && cargo build --release --bins -q)
fi

mkdir -p "$BENCH_DIR" "$REPO/bench/results"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
WORK=$(mktemp -d "$BENCH_DIR/run-$STAMP-XXXX")
RAW_JSON=$WORK/raw
mkdir -p "$RAW_JSON"

URING_PARAM=/sys/module/fuse/parameters/enable_uring
URING_WAS=$(cat "$URING_PARAM" 2>/dev/null || true)
if [[ -n ${BENCH_TRANSPORTS:-} ]]; then
    read -r -a TRANSPORTS <<<"$BENCH_TRANSPORTS"
elif [[ -w $URING_PARAM ]]; then
    TRANSPORTS=(classic uring)
else
    TRANSPORTS=(classic)
    echo "bench: this kernel has no FUSE over io_uring ($URING_PARAM): classic transport only"
fi

NODE_MNTS=() # mountpoints that are mounted
cleanup() {
    local m
    for m in "${NODE_MNTS[@]}"; do
        umount "$m" 2>/dev/null || fusermount3 -u "$m" 2>/dev/null || true
    done
    [[ $URING_WAS == [YN] ]] && echo "$([[ $URING_WAS == Y ]] && echo 1 || echo 0)" >"$URING_PARAM"
    rm -f "$WORK"/*.img
}
trap cleanup EXIT

prefill() { # target [size_bytes]
    local t0 t1 size=${2:-$SIZE_B}
    t0=$(date +%s.%N)
    FILENAME=$1 SIZE=$size OFFSET=0 fio --output-format=terse "$REPO/bench/fio/prefill.fio" >/dev/null
    t1=$(date +%s.%N)
    python3 -c "import sys; print(f'  prefill {int(sys.argv[1])>>20} MiB of {sys.argv[4]} in {float(sys.argv[3])-float(sys.argv[2]):.1f}s')" "$size" "$t0" "$t1" "$1"
}

# N fio processes at once, process i on TARGETS[i] at OFFSETS[i]; JSON+ (with latency
# histograms, merged in the report) to outdir/<job>.node<i>.json, and the CPU time the
# daemons DAEMONS[@] used meanwhile to outdir/<job>.cpu ("ticks clk_tck seconds").
run_fio_nodes() { # job outdir
    local job=$1 out=$2 i pids=() rc=0 c0 c1 t0 t1
    echo "  $job x $NODES at once ..."
    c0=$(daemon_ticks)
    t0=$(date +%s.%N)
    for ((i = 1; i <= NODES; i++)); do
        FILENAME=${TARGETS[i]} SIZE=$SIZE_B OFFSET=${OFFSETS[i]} RUNTIME=$RUNTIME \
            fio --output-format=json+ --output="$out/$job.node$i.json" "$REPO/bench/fio/$job.fio" >/dev/null &
        pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i" || rc=1; done
    t1=$(date +%s.%N)
    c1=$(daemon_ticks)
    ((rc == 0)) || die "fio failed for $job (see $out/$job.node*.json)"
    echo "$((c1 - c0)) $(getconf CLK_TCK) $(python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$t0" "$t1")" >"$out/$job.cpu"
}

# user+system clock ticks of the running daemons (DAEMONS), 0 without any.
daemon_ticks() {
    local t=0 p v
    for p in "${DAEMONS[@]}"; do
        v=$(awk '{ print $14 + $15 }' "/proc/$p/stat" 2>/dev/null || echo 0)
        t=$((t + v))
    done
    echo "$t"
}

declare -a TARGETS=() OFFSETS=() DAEMONS=()
pick_luns
echo "bench: $NODES node(s); LUNs: $RAW_KIND, $((LUN_B >> 20)) MiB each; $NODES image(s) of $SIZE; ${RUNTIME}s per workload; transports: ${TRANSPORTS[*]}"
# Both LUNs written in full before anything reads them: what a LUN file holds must not
# depend on which one it is (a hole reads without touching the disk).
prefill "$RAW" "$LUN_B"
[[ $CETRA_LUN == "$RAW" ]] || prefill "$CETRA_LUN" "$LUN_B"

# ---- raw LUN, N disjoint regions at once -----------------------------------------------------
for ((i = 1; i <= NODES; i++)); do
    TARGETS[i]=$RAW
    OFFSETS[i]=$(((i - 1) * SIZE_B))
done
for w in "${WORKLOADS[@]}"; do run_fio_nodes "$w" "$RAW_JSON"; done

# ---- CetraFS, once per transport: N daemons on one fresh volume, one image each -------------
for tr in "${TRANSPORTS[@]}"; do
    case $tr in
        classic) ;;
        uring) echo 1 >"$URING_PARAM" || die "cannot set $URING_PARAM" ;;
        *) die "unknown transport $tr (classic or uring)" ;;
    esac
    out=$WORK/cetrafs-$tr
    mkdir -p "$out"
    echo "bench: CetraFS on $CETRA_LUN, $NODES mount-cetra daemon(s), transport=$tr"
    "$BIN_DIR/mkfs-cetra" -q --force -L bench "$CETRA_LUN"
    DAEMONS=()
    for ((i = 1; i <= NODES; i++)); do
        m=$WORK/mnt-node$i
        mkdir -p "$m"
        CETRA_LOG_FILE=$WORK/mount-$tr-node$i.log "$BIN_DIR/mount-cetra" "$CETRA_LUN" "$m" -o "host=node$i,transport=$tr"
        NODE_MNTS+=("$m")
        DAEMONS+=($(pgrep -f "^$BIN_DIR/mount-cetra $CETRA_LUN $m " || true))
        grep -h "FUSE transport" "$WORK/mount-$tr-node$i.log" | sed 's/^.*: FUSE transport: /  node'$i': /'
    done
    # Prefill one image per node, one node after the other (each file written sequentially
    # once, as an installed VM disk would be), so the runs measure the fast path.
    for ((i = 1; i <= NODES; i++)); do
        TARGETS[i]=$WORK/mnt-node$i/vm-10$i-disk-0.raw
        OFFSETS[i]=0
        prefill "${TARGETS[i]}"
    done
    for w in "${WORKLOADS[@]}"; do run_fio_nodes "$w" "$out"; done
    for ((i = 1; i <= NODES; i++)); do rm -f "${TARGETS[i]}"; done
    # Unmount every node and wait for its daemon to flush and exit.
    for m in "${NODE_MNTS[@]}"; do umount "$m"; done
    NODE_MNTS=()
    for pid in "${DAEMONS[@]}"; do
        for ((t = 0; t < 600; t++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done
    DAEMONS=()
done

# ---- report ------------------------------------------------------------------------------------
if ((NODES > 1)); then OUT=$REPO/bench/results/$STAMP-${NODES}nodes.json; else OUT=$REPO/bench/results/$STAMP.json; fi
python3 "$REPO/bench/report.py" "$WORK" "$OUT" "$RUNTIME" "$SIZE" "$RAW_KIND" "$NODES" "${TRANSPORTS[*]}" "${WORKLOADS[@]}"
