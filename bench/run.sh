#!/bin/bash
# CetraFS storage benchmark: the six workloads of the public Proxmox storage benchmark, run
# first against the raw LUN and then against a fully written image file on a CetraFS mount of
# the same kind of LUN, in one run. Prints a table (IOPS, MiB/s, p50/p99 latency, ratio
# CetraFS/raw) and writes bench/results/<timestamp>.json.
#
# Usage: bench/run.sh [--nodes N] [BLOCK_DEVICE]
#   no argument: both LUNs are sparse files under $BENCH_DIR (default <repo>/.cache/bench),
#                on the same filesystem.
#   BLOCK_DEVICE: raw runs against the device, then it is formatted (DESTROYS ITS DATA; set
#                BENCH_DESTROY=1 to confirm) and mounted for the CetraFS runs.
#   --nodes N (N > 1): the multi-node mode, N nodes on one LUN, all N at once for every workload:
#                raw: N fio processes on the raw LUN, each on its own disjoint region
#                (offset = i x image size); CetraFS: one freshly made volume mounted by N
#                mount-cetra daemons (host=node1..N, one mountpoint each), each fio process on
#                its own prefilled image in its own mountpoint. Reports per workload the
#                aggregate IOPS and MiB/s (sum of the N), p50/p99 from the merged latency
#                histograms, and the ratio; writes bench/results/<timestamp>-<N>nodes.json.
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
# files side by side.
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
        RAW_KIND="sparse file on $(df --output=fstype "$WORK" | tail -1) ($WORK)"
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
MNT=$WORK/mnt
RAW_JSON=$WORK/raw
CETRA_JSON=$WORK/cetrafs
mkdir -p "$MNT" "$RAW_JSON" "$CETRA_JSON"
MOUNTED=0

NODE_MNTS=() # mountpoints of the multi-node mode that are mounted
cleanup() {
    local m
    if ((MOUNTED)); then
        umount "$MNT" 2>/dev/null || fusermount3 -u "$MNT" 2>/dev/null || true
    fi
    for m in "${NODE_MNTS[@]}"; do
        umount "$m" 2>/dev/null || fusermount3 -u "$m" 2>/dev/null || true
    done
    rm -f "$WORK"/*.img
}
trap cleanup EXIT

run_fio() { # job target outdir
    local job=$1 target=$2 out=$3
    echo "  $job ..."
    FILENAME=$target SIZE=$SIZE_B OFFSET=0 RUNTIME=$RUNTIME \
        fio --output-format=json --output="$out/$job.json" "$REPO/bench/fio/$job.fio" >/dev/null
}

prefill() { # target [size_bytes]
    local t0 t1 size=${2:-$SIZE_B}
    t0=$(date +%s.%N)
    FILENAME=$1 SIZE=$size OFFSET=0 fio --output-format=terse "$REPO/bench/fio/prefill.fio" >/dev/null
    t1=$(date +%s.%N)
    python3 -c "import sys; print(f'  prefill {int(sys.argv[1])>>20} MiB of {sys.argv[4]} in {float(sys.argv[3])-float(sys.argv[2]):.1f}s')" "$size" "$t0" "$t1" "$1"
}

# Multi-node mode: N fio processes at once, process i on TARGETS[i] at OFFSETS[i]; JSON+
# (with latency histograms, merged in the report) to outdir/<job>.node<i>.json.
run_fio_nodes() { # job outdir
    local job=$1 out=$2 i pids=() rc=0
    echo "  $job x $NODES at once ..."
    for ((i = 1; i <= NODES; i++)); do
        FILENAME=${TARGETS[i]} SIZE=$SIZE_B OFFSET=${OFFSETS[i]} RUNTIME=$RUNTIME \
            fio --output-format=json+ --output="$out/$job.node$i.json" "$REPO/bench/fio/$job.fio" >/dev/null &
        pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i" || rc=1; done
    ((rc == 0)) || die "fio failed for $job (see $out/$job.node*.json)"
}


if ((NODES > 1)); then
    # ---- multi-node: raw LUN, N disjoint regions at once -----------------------------------
    declare -a TARGETS=() OFFSETS=() DAEMONS=()
    pick_luns
    echo "bench: $NODES nodes; raw LUN: $RAW_KIND, $NODES regions of $SIZE, ${RUNTIME}s per workload"
    prefill "$RAW" $((NODES * SIZE_B))
    for ((i = 1; i <= NODES; i++)); do
        TARGETS[i]=$RAW
        OFFSETS[i]=$(((i - 1) * SIZE_B))
    done
    for w in "${WORKLOADS[@]}"; do run_fio_nodes "$w" "$RAW_JSON"; done

    # ---- multi-node: CetraFS, N daemons on one volume, one image each ----------------------
    echo "bench: CetraFS on $CETRA_LUN, $NODES mount-cetra daemons (host=node1..$NODES)"
    "$BIN_DIR/mkfs-cetra" -q --force -L bench "$CETRA_LUN"
    for ((i = 1; i <= NODES; i++)); do
        m=$WORK/mnt-node$i
        mkdir -p "$m"
        CETRA_LOG_FILE=$WORK/mount-node$i.log "$BIN_DIR/mount-cetra" "$CETRA_LUN" "$m" -o "host=node$i"
        NODE_MNTS+=("$m")
        grep -h "holds slot" "$WORK/mount-node$i.log" | sed 's/^.*: /  /'
    done
    # Prefill one image per node, one node after the other (each file written sequentially
    # once, as an installed VM disk would be), so the runs measure the fast path.
    for ((i = 1; i <= NODES; i++)); do
        TARGETS[i]=$WORK/mnt-node$i/vm-10$i-disk-0.raw
        OFFSETS[i]=0
        prefill "${TARGETS[i]}"
    done
    for w in "${WORKLOADS[@]}"; do run_fio_nodes "$w" "$CETRA_JSON"; done
    for ((i = 1; i <= NODES; i++)); do rm -f "${TARGETS[i]}"; done
    # Unmount every node and wait for its daemon to flush and exit.
    for m in "${NODE_MNTS[@]}"; do
        DAEMONS+=($(pgrep -f "^$BIN_DIR/mount-cetra $CETRA_LUN $m " || true))
        umount "$m"
    done
    NODE_MNTS=()
    for pid in "${DAEMONS[@]}"; do
        for ((t = 0; t < 600; t++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done

    # ---- multi-node report -----------------------------------------------------------------
    OUT=$REPO/bench/results/$STAMP-${NODES}nodes.json
    python3 - "$RAW_JSON" "$CETRA_JSON" "$OUT" "$RUNTIME" "$SIZE" "$RAW_KIND" "$NODES" "${WORKLOADS[@]}" <<'PY'
import json, os, platform, sys

raw_dir, cetra_dir, out, runtime, size, raw_kind, nodes, *workloads = sys.argv[1:]
nodes = int(nodes)

def pct(bins, q):
    """q-th percentile (0..100) of a merged fio completion-latency histogram, in us."""
    total = sum(bins.values())
    if not total:
        return None
    need, acc = total * q / 100.0, 0
    for v in sorted(bins):
        acc += bins[v]
        if acc >= need:
            return v / 1000
    return max(bins) / 1000

def summarize(d, w):
    res = {"iops": 0.0, "mib_s": 0.0, "per_node_iops": []}
    bins = {}
    for i in range(1, nodes + 1):
        j = json.load(open(os.path.join(d, f"{w}.node{i}.json")))["jobs"][0]
        node_iops, lat_side = 0.0, None
        for side in ("read", "write"):
            s = j[side]
            if s["total_ios"] == 0:
                continue
            node_iops += s["iops"]
            res["mib_s"] += s["bw_bytes"] / (1 << 20)
            # For mixed workloads the read side's latency (what a guest waits on).
            if lat_side is None:
                lat_side = side
                for v, c in s["clat_ns"].get("bins", {}).items():
                    bins[int(v)] = bins.get(int(v), 0) + c
        res["iops"] += node_iops
        res["per_node_iops"].append(round(node_iops))
    res["p50_us"], res["p99_us"] = pct(bins, 50), pct(bins, 99)
    return res

results = {"raw": {}, "cetrafs": {}, "ratio": {}}
for w in workloads:
    r, c = summarize(raw_dir, w), summarize(cetra_dir, w)
    results["raw"][w], results["cetrafs"][w] = r, c
    results["ratio"][w] = {
        "iops": c["iops"] / r["iops"] if r["iops"] else None,
        "mib_s": c["mib_s"] / r["mib_s"] if r["mib_s"] else None,
        "p99": c["p99_us"] / r["p99_us"] if r["p99_us"] and c["p99_us"] else None,
    }

json.dump({
    "timestamp": os.path.basename(out).split("-")[0],
    "nodes": nodes,
    "runtime_s": int(runtime),
    "image_size_per_node": size,
    "raw_lun": raw_kind,
    "host": {"kernel": platform.release(), "cpus": os.cpu_count()},
    "results": results,
}, open(out, "w"), indent=2)

def f(v, fmt):
    return "-" if v is None else format(v, fmt)

print(f"\n{nodes} nodes at once: aggregate IOPS and MiB/s (sum over the {nodes} fio processes), "
      "p50/p99 completion latency from the merged histograms (read side for the mixed job)")
hdr = (f"{'workload':<22}{'raw IOPS':>10}{'raw MiB/s':>10}{'raw p50/p99 us':>17}  "
       f"{'cetra IOPS':>10}{'cetra MiB/s':>12}{'cetra p50/p99 us':>18}  {'ratio':>6}{'p99 x':>7}")
print(hdr)
print("-" * len(hdr))
for w in workloads:
    r, c, q = results["raw"][w], results["cetrafs"][w], results["ratio"][w]
    print(f"{w:<22}{r['iops']:>10.0f}{r['mib_s']:>10.1f}{f(r['p50_us'],'.0f'):>8}/{f(r['p99_us'],'.0f'):<8}  "
          f"{c['iops']:>10.0f}{c['mib_s']:>12.1f}{f(c['p50_us'],'.0f'):>9}/{f(c['p99_us'],'.0f'):<8}  "
          f"{f(q['iops'],'.2f'):>6}{f(q['p99'],'.2f'):>7}")
print("\nper-node IOPS (raw | CetraFS):")
for w in workloads:
    print(f"  {w:<22}{str(results['raw'][w]['per_node_iops']):<28}| {results['cetrafs'][w]['per_node_iops']}")
print(f"\nratio = CetraFS IOPS / raw IOPS; p99 x = CetraFS p99 / raw p99. JSON: {out}")
PY
    exit 0
fi

# ---- raw LUN --------------------------------------------------------------------------------
pick_luns

echo "bench: raw LUN: $RAW_KIND, image size $SIZE, ${RUNTIME}s per workload"
prefill "$RAW"
for w in "${WORKLOADS[@]}"; do run_fio "$w" "$RAW" "$RAW_JSON"; done

# ---- CetraFS --------------------------------------------------------------------------------
echo "bench: CetraFS on ${CETRA_LUN}"
"$BIN_DIR/mkfs-cetra" -q --force -L bench "$CETRA_LUN"
CETRA_LOG_FILE=$WORK/mount.log "$BIN_DIR/mount-cetra" "$CETRA_LUN" "$MNT" -o host=bench
MOUNTED=1
IMG=$MNT/vm-100-disk-0.raw
prefill "$IMG"
for w in "${WORKLOADS[@]}"; do run_fio "$w" "$IMG" "$CETRA_JSON"; done
rm -f "$IMG"
umount "$MNT"
MOUNTED=0

# ---- report ---------------------------------------------------------------------------------
OUT=$REPO/bench/results/$STAMP.json
python3 - "$RAW_JSON" "$CETRA_JSON" "$OUT" "$RUNTIME" "$SIZE" "$RAW_KIND" "${WORKLOADS[@]}" <<'PY'
import json, os, platform, sys

raw_dir, cetra_dir, out, runtime, size, raw_kind, *workloads = sys.argv[1:]

def summarize(path):
    j = json.load(open(path))["jobs"][0]
    res = {"iops": 0.0, "mib_s": 0.0}
    lat = None
    for d in ("read", "write"):
        s = j[d]
        if s["total_ios"] == 0:
            continue
        res["iops"] += s["iops"]
        res["mib_s"] += s["bw_bytes"] / (1 << 20)
        pct = s.get("clat_ns", {}).get("percentile", {})
        # For mixed workloads report the read side's latency (what a guest waits on).
        if lat is None and pct:
            lat = {"p50_us": pct.get("50.000000", 0) / 1000, "p99_us": pct.get("99.000000", 0) / 1000}
    res.update(lat or {"p50_us": None, "p99_us": None})
    return res

results = {"raw": {}, "cetrafs": {}, "ratio": {}}
for w in workloads:
    r = summarize(os.path.join(raw_dir, w + ".json"))
    c = summarize(os.path.join(cetra_dir, w + ".json"))
    results["raw"][w], results["cetrafs"][w] = r, c
    results["ratio"][w] = {
        "iops": c["iops"] / r["iops"] if r["iops"] else None,
        "mib_s": c["mib_s"] / r["mib_s"] if r["mib_s"] else None,
    }

doc = {
    "timestamp": os.path.basename(out)[:-5],
    "runtime_s": int(runtime),
    "image_size": size,
    "raw_lun": raw_kind,
    "host": {"kernel": platform.release(), "cpus": os.cpu_count()},
    "results": results,
}
json.dump(doc, open(out, "w"), indent=2)

def f(v, fmt):
    return "-" if v is None else format(v, fmt)

hdr = f"{'workload':<22}{'raw IOPS':>10}{'raw MiB/s':>10}{'raw p50/p99 us':>17}  {'cetra IOPS':>10}{'cetra MiB/s':>12}{'cetra p50/p99 us':>18}  {'ratio':>6}"
print()
print(hdr)
print("-" * len(hdr))
for w in workloads:
    r, c, q = results["raw"][w], results["cetrafs"][w], results["ratio"][w]
    print(f"{w:<22}{r['iops']:>10.0f}{r['mib_s']:>10.1f}{f(r['p50_us'],'.0f'):>8}/{f(r['p99_us'],'.0f'):<8}  "
          f"{c['iops']:>10.0f}{c['mib_s']:>12.1f}{f(c['p50_us'],'.0f'):>9}/{f(c['p99_us'],'.0f'):<8}  {f(q['iops'],'.2f'):>6}")
print(f"\nratio = CetraFS IOPS / raw IOPS. JSON: {out}")
PY
