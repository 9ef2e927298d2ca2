#!/bin/bash
# CetraFS storage benchmark: the six workloads of the public Proxmox storage benchmark, run
# first against the raw LUN and then against a fully written image file on a CetraFS mount of
# the same kind of LUN, in one run. Prints a table (IOPS, MiB/s, p50/p99 latency, ratio
# CetraFS/raw) and writes bench/results/<timestamp>.json.
#
# Usage: bench/run.sh [BLOCK_DEVICE]
#   no argument: both LUNs are sparse files under $BENCH_DIR (default <repo>/.cache/bench),
#                on the same filesystem.
#   BLOCK_DEVICE: raw runs against the device, then it is formatted (DESTROYS ITS DATA; set
#                BENCH_DESTROY=1 to confirm) and mounted for the CetraFS runs.
# Environment: BENCH_RUNTIME (seconds per workload, default 15), BENCH_SIZE (image size,
#   default 4G), BENCH_DIR, BENCH_ONLY (space-separated subset of workload names),
#   CETRA_BIN_DIR (default target/release; built if missing).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNTIME=${BENCH_RUNTIME:-15}
SIZE=${BENCH_SIZE:-4G}
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
# The CetraFS LUN holds the image plus journals (16 x 64 MiB by default) and metadata.
LUN_B=$((SIZE_B + (2 << 30)))

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

cleanup() {
    if ((MOUNTED)); then
        umount "$MNT" 2>/dev/null || fusermount3 -u "$MNT" 2>/dev/null || true
    fi
    rm -f "$WORK"/*.img
}
trap cleanup EXIT

run_fio() { # job target outdir
    local job=$1 target=$2 out=$3
    echo "  $job ..."
    FILENAME=$target SIZE=$SIZE_B RUNTIME=$RUNTIME \
        fio --output-format=json --output="$out/$job.json" "$REPO/bench/fio/$job.fio" >/dev/null
}

prefill() { # target
    local t0 t1
    t0=$(date +%s.%N)
    FILENAME=$1 SIZE=$SIZE_B fio --output-format=terse "$REPO/bench/fio/prefill.fio" >/dev/null
    t1=$(date +%s.%N)
    python3 -c "import sys; print(f'  prefill {int(sys.argv[1])>>20} MiB in {float(sys.argv[3])-float(sys.argv[2]):.1f}s')" "$SIZE_B" "$t0" "$t1"
}

# ---- raw LUN --------------------------------------------------------------------------------
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
