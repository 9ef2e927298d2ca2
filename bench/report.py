#!/usr/bin/env python3
"""The report of bench/run.sh: raw LUN against CetraFS per FUSE transport, from fio's JSON+.

Usage: report.py WORK OUT RUNTIME SIZE RAW_KIND NODES "TRANSPORTS" WORKLOAD...
WORK holds raw/ and cetrafs-<transport>/, each with <workload>.node<i>.json (fio JSON+) and
<workload>.cpu ("daemon_ticks clk_tck wall_seconds"). Writes OUT (JSON) and prints tables.
"""
import json
import os
import platform
import sys


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


def summarize(d, w, nodes):
    res = {"iops": 0.0, "mib_s": 0.0, "per_node_iops": []}
    bins, fio_cpu_s, fio_ios = {}, 0.0, 0
    for i in range(1, nodes + 1):
        j = json.load(open(os.path.join(d, f"{w}.node{i}.json")))["jobs"][0]
        node_iops, lat_side = 0.0, None
        for side in ("read", "write"):
            s = j[side]
            if s["total_ios"] == 0:
                continue
            node_iops += s["iops"]
            fio_ios += s["total_ios"]
            res["mib_s"] += s["bw_bytes"] / (1 << 20)
            # For mixed workloads the read side's latency (what a guest waits on).
            if lat_side is None:
                lat_side = side
                for v, c in s["clat_ns"].get("bins", {}).items():
                    bins[int(v)] = bins.get(int(v), 0) + c
        # fio's usr/sys are percentages of one CPU over the job's runtime (ramp excluded).
        fio_cpu_s += (j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] / 1000
        res["iops"] += node_iops
        res["per_node_iops"].append(round(node_iops))
    res["p50_us"], res["p99_us"] = pct(bins, 50), pct(bins, 99)
    # CPU seconds per 1,000 I/Os: fio's own (for the raw LUN: the whole I/O path), and the
    # daemons' over the whole fio run (ramp included), divided by IOPS x that run's length.
    res["fio_cpu_ms_per_kio"] = fio_cpu_s / fio_ios * 1e6 if fio_ios else None
    ticks, hz, wall = open(os.path.join(d, f"{w}.cpu")).read().split()
    daemon_s = int(ticks) / int(hz)
    ios = res["iops"] * float(wall)
    res["daemon_cpu_ms_per_kio"] = daemon_s / ios * 1e6 if ios and daemon_s else None
    return res


def main():
    work, out, runtime, size, raw_kind, nodes, transports, *workloads = sys.argv[1:]
    nodes, transports = int(nodes), transports.split()
    results = {"raw": {}, "ratio": {}}
    for w in workloads:
        results["raw"][w] = summarize(os.path.join(work, "raw"), w, nodes)
    for t in transports:
        results[t] = {w: summarize(os.path.join(work, f"cetrafs-{t}"), w, nodes) for w in workloads}
        results["ratio"][t] = {}
        for w in workloads:
            r, c = results["raw"][w], results[t][w]
            results["ratio"][t][w] = {
                "iops": c["iops"] / r["iops"] if r["iops"] else None,
                "p99": c["p99_us"] / r["p99_us"] if r["p99_us"] and c["p99_us"] else None,
            }
    json.dump({
        "timestamp": os.path.basename(out).split("-")[0].removesuffix(".json"),
        "nodes": nodes,
        "runtime_s": int(runtime),
        "image_size_per_node": size,
        "raw_lun": raw_kind,
        "transports": transports,
        "host": {"kernel": platform.release(), "cpus": os.cpu_count()},
        "results": results,
    }, open(out, "w"), indent=2)

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    agg = f"{nodes} nodes at once, aggregate IOPS; " if nodes > 1 else ""
    print(f"\n{agg}p50/p99 completion latency in us (read side for the mixed job); "
          "ratio = CetraFS IOPS / raw IOPS; CPU = ms per 1,000 I/Os (daemons; fio in brackets)")
    hdr = f"{'workload':<22}{'raw IOPS':>9}{'p50/p99':>13}{'fio CPU':>9}"
    for t in transports:
        hdr += f"  | {t + ' IOPS':>13}{'p50/p99':>13}{'ratio':>6}{'CPU':>6}{'(fio)':>7}"
    print(hdr)
    print("-" * len(hdr))
    for w in workloads:
        r = results["raw"][w]
        line = (f"{w:<22}{r['iops']:>9.0f}{f(r['p50_us'], '.0f'):>7}/{f(r['p99_us'], '.0f'):<5}"
                f"{f(r['fio_cpu_ms_per_kio'], '.1f'):>9}")
        for t in transports:
            c, q = results[t][w], results["ratio"][t][w]
            line += (f"  | {c['iops']:>13.0f}{f(c['p50_us'], '.0f'):>7}/{f(c['p99_us'], '.0f'):<5}"
                     f"{f(q['iops'], '.2f'):>6}{f(c['daemon_cpu_ms_per_kio'], '.1f'):>6}"
                     f"{'(' + f(c['fio_cpu_ms_per_kio'], '.1f') + ')':>7}")
        print(line)
    if "classic" in transports and "uring" in transports:
        print("\nuring against classic, same run: IOPS x, daemon CPU per I/O x, p50 latency x")
        for w in workloads:
            c, u = results["classic"][w], results["uring"][w]
            cpu = (u["daemon_cpu_ms_per_kio"] / c["daemon_cpu_ms_per_kio"]
                   if u["daemon_cpu_ms_per_kio"] and c["daemon_cpu_ms_per_kio"] else None)
            p50 = u["p50_us"] / c["p50_us"] if u["p50_us"] and c["p50_us"] else None
            print(f"  {w:<22} IOPS {f(u['iops'] / c['iops'] if c['iops'] else None, '.2f'):>5}x"
                  f"   CPU/IO {f(cpu, '.2f'):>5}x   p50 {f(p50, '.2f'):>5}x")
    if nodes > 1:
        print("\nper-node IOPS:")
        for w in workloads:
            row = " | ".join(f"{t} {results[t][w]['per_node_iops']}" for t in ["raw"] + transports)
            print(f"  {w:<22}{row}")
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
