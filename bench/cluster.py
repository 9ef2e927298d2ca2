#!/usr/bin/env python3
"""Drivers and report of bench/cluster.sh (see its header). Subcommands:

  meta   --dir D --seconds T --start EPOCH --mode cru|create --tag NAME --out F
         From wall-clock time EPOCH (so that several processes start together) for T seconds:
         mode cru: create (open O_CREAT|O_EXCL + close), rename (same directory) and unlink one
         file after the other, each counted as one op; mode create: create files only. Writes
         {"ops", "seconds", "p50_us", "p99_us"} (per-op latency) to F.
  bounce --a PATH --b PATH --count N --mode utime|write --out F
         PATH a and b are the same file seen through two nodes' mountpoints. Changes it
         alternately through a and b, so that every op waits for the other node to hand over
         that inode's lock. utime: futimens on a descriptor held open on each node (a
         setattr); write: open for writing + one-byte pwrite at offset 0 + fsync + close (a
         file open for writing on one node cannot be opened for writing on another, so each
         turn opens it: this includes the open registration's cost). One process does both
         sides in turn, so the handshake costs nothing. Writes per-op latencies (first two ops
         dropped) to F.
  report RESULTS_DIR OUT_JSON
         Prints the table (ratios computed here, each line PASS/MISS against its target) and
         writes OUT_JSON.

Python's own cost per op (a few microseconds) is small next to a FUSE round trip.
"""
import argparse
import glob
import errno
import json
import os
import platform
import sys
import time

# The merged-histogram percentile lives with bench/run.sh's report (this directory is on the path).
from report import pct as hist_pct


def pct(sorted_vals, q):
    if not sorted_vals:
        return None
    i = min(len(sorted_vals) - 1, max(0, int(round(q / 100.0 * len(sorted_vals) + 0.5)) - 1))
    return sorted_vals[i]


# ---- drivers -----------------------------------------------------------------------------------


def cmd_meta(a):
    os.makedirs(a.dir, exist_ok=True)
    delay = a.start - time.time()
    if delay > 0:
        time.sleep(delay)
    lat = []
    ops = 0
    i = 0
    t0 = time.monotonic()
    end = t0 + a.seconds
    now = time.perf_counter_ns
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
    while time.monotonic() < end:
        p = os.path.join(a.dir, f"{a.tag}-{i}")
        t = now()
        os.close(os.open(p, flags, 0o644))
        t1 = now()
        lat.append(t1 - t)
        ops += 1
        if a.mode == "cru":
            q = p + ".r"
            os.rename(p, q)
            t2 = now()
            os.unlink(q)
            t3 = now()
            lat.append(t2 - t1)
            lat.append(t3 - t2)
            ops += 2
        i += 1
    dt = time.monotonic() - t0
    lat.sort()
    json.dump({"ops": ops, "seconds": dt, "rate": ops / dt,
               "p50_us": pct(lat, 50) / 1000 if lat else None,
               "p99_us": pct(lat, 99) / 1000 if lat else None}, open(a.out, "w"))


def cmd_bounce(a):
    paths = [a.a, a.b]
    # Read-only descriptors: a second node cannot open a file for writing that another node has
    # open for writing (open registrations, unless mounted nofilelock); futimens needs none.
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    lat = []
    for i in range(a.count + 2):
        t = time.perf_counter_ns()
        if a.mode == "utime":
            s = time.time_ns()
            os.utime(fds[i % 2], ns=(s, s))
        else:
            # The other node's close reaches its daemon as an asynchronous FUSE RELEASE: until
            # it has deregistered its writer, this open is refused (EBUSY). The retry is part
            # of the handoff and counted in its latency.
            deadline = time.monotonic() + 2
            while True:
                try:
                    fd = os.open(paths[i % 2], os.O_WRONLY)
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    time.sleep(0.0005)
            os.pwrite(fd, bytes([i & 0xFF]), 0)
            os.fsync(fd)
            os.close(fd)
        d = time.perf_counter_ns() - t
        if i >= 2:
            lat.append(d / 1000)
    for fd in fds:
        os.close(fd)
    s = sorted(lat)
    json.dump({"mode": a.mode, "count": len(lat), "p50_us": pct(s, 50), "p99_us": pct(s, 99),
               "max_us": s[-1], "mean_us": sum(s) / len(s)}, open(a.out, "w"))


# ---- report ------------------------------------------------------------------------------------


def fio_group(res, name):
    """Aggregate the fio json+ files res/<name>.node*.json: summed IOPS, merged-histogram p50/p99
    (us) of the side that did I/O, per-node IOPS."""
    files = sorted(glob.glob(os.path.join(res, f"{name}.node*.json")))
    if not files:
        return None
    out = {"iops": 0.0, "per_node": [], "mib": 0.0}
    bins = {}
    for f in files:
        j = json.load(open(f))["jobs"][0]
        n = 0.0
        for side in ("read", "write"):
            s = j[side]
            if s["total_ios"] == 0:
                continue
            n += s["iops"]
            out["mib"] += s["io_bytes"] / (1 << 20)
            for v, c in s["clat_ns"].get("bins", {}).items():
                bins[int(v)] = bins.get(int(v), 0) + c
        out["iops"] += n
        out["per_node"].append(round(n))
    out["p50_us"], out["p99_us"] = hist_pct(bins, 50), hist_pct(bins, 99)
    return out


def meta_group(res, name):
    files = sorted(glob.glob(os.path.join(res, f"{name}.node*.json")))
    if not files:
        return None
    rs = [json.load(open(f)) for f in files]
    return {"rate": sum(r["rate"] for r in rs), "per_node": [round(r["rate"]) for r in rs],
            "p99_us": max(r["p99_us"] or 0 for r in rs)}


def iops_log(path):
    """[(t_ms, iops)] from a fio --write_iops_log file (log_avg_msec=1000)."""
    rows = []
    for line in open(path):
        p = [x.strip() for x in line.split(",")]
        if len(p) >= 2 and p[0]:
            rows.append((int(p[0]), float(p[1])))
    return rows


def zero_runs(rows, runtime_s):
    """Seconds with zero completions. fio writes no entry for a second in which nothing
    completed, so these are the seconds missing from the log (a gap of more than 1.5 s between
    entries, or before the first / after the last entry of a run of runtime_s), plus any logged
    zero. Returns (count, longest run, start of that run in s)."""
    zero, longest, start, cur, cur_start, prev_t = 0, 0, None, 0, None, 0
    rows = rows + [(runtime_s * 1000, None)]
    for t, v in rows:
        if prev_t is not None and t - prev_t > 1500:
            missing = round((t - prev_t) / 1000) - 1
            zero += missing
            if cur == 0:
                cur_start = prev_t / 1000
            cur += missing
        if v is None:
            break
        if v == 0:
            zero += 1
            if cur == 0:
                cur_start = t / 1000 - 1
            cur += 1
        else:
            if cur > longest:
                longest, start = cur, cur_start
            cur = 0
        prev_t = t
    if cur > longest:
        longest, start = cur, cur_start
    return zero, longest, start


def cmd_report(a):
    res = a.results
    meta = json.load(open(os.path.join(res, "run.json")))
    lines = []  # (section, what, measured text, ratio/value, target text, ok)
    data = {}

    def mark(ok):
        return "-" if ok is None else ("PASS" if ok else "MISS")

    def f(v, fmt=".0f"):
        return "-" if v is None else format(v, fmt)

    def ratio(x, y):
        return x / y if x is not None and y else None

    # §1 fresh vs prefilled randwrite
    for n in ("1", "3"):
        fr, pre = fio_group(res, f"c-fresh{n}"), fio_group(res, f"c-pre{n}")
        rfr, rpre = fio_group(res, f"raw-fresh{n}"), fio_group(res, f"raw-pre{n}")
        if fr and pre:
            q = ratio(fr["iops"], pre["iops"])
            data[f"randwrite_{n}node"] = {"fresh": fr, "prefilled": pre, "raw_fresh": rfr,
                                          "raw_prefilled": rpre, "ratio": q}
            lines.append(("1", f"randwrite 4k QD32 fresh/prefilled, {n} node{'s at once' if n == '3' else ''}",
                          f"{f(fr['iops'])} / {f(pre['iops'])} IOPS", q, ">= 0.80", q is not None and q >= 0.8))
    # §2 readers under node 1's load, unpinned and pinned (node 1 on its own CPU)
    for p, label, key2 in (("s2", "", "read_under_load"), ("s2p", " pinned", "read_under_load_pinned")):
        idle = fio_group(res, f"{p}-idle")
        if not idle:
            continue
        data[key2] = {"idle": idle}
        for key, what in (("write", "(b) n1 writes thin"), ("create", "(c) n1 creates"), ("over", None)):
            g = fio_group(res, f"{p}-{key}")
            if not g:
                continue
            qi, qp = ratio(g["iops"], idle["iops"]), ratio(g["p99_us"], idle["p99_us"])
            data[key2][key] = dict(g, iops_ratio=qi, p99_ratio=qp)
            if what is None:  # (d) is context, not a target
                continue
            lines.append(("2", f"randread n2+n3 IOPS{label}, {what} / (a) idle",
                          f"{f(g['iops'])} / {f(idle['iops'])} IOPS", qi, ">= 0.90", qi is not None and qi >= 0.9))
            lines.append(("2", f"randread n2+n3 p99{label}, {what} / (a) idle",
                          f"{f(g['p99_us'])} / {f(idle['p99_us'])} us", qp, "<= 1.30", qp is not None and qp <= 1.3))
    # §3 metadata ops
    one, priv, shared = (meta_group(res, n) for n in ("s3-one", "s3-private", "s3-shared"))
    if one:
        data["meta_ops"] = {"one": one, "private": priv, "shared": shared}
        if priv:
            q = ratio(priv["rate"], one["rate"])
            lines.append(("3", "create+rename+unlink, 3 nodes private / 1 node",
                          f"{f(priv['rate'])} / {f(one['rate'])} ops/s", q, ">= 1.50", q is not None and q >= 1.5))
        if shared:
            lines.append(("3", "create+rename+unlink, 3 nodes one dir, ops/s",
                          f"{f(shared['rate'])} ops/s", shared["rate"], ">= 1000", shared["rate"] >= 1000))
            q = ratio(shared["rate"], one["rate"])
            lines.append(("3", "create+rename+unlink, 3 nodes one dir / 1 node",
                          f"{f(shared['rate'])} / {f(one['rate'])} ops/s", q, ">= 0.80", q is not None and q >= 0.8))
    # §4 lock bounce
    for mode, what in (("utime", "futimens"), ("write", "open+write+fsync+close")):
        p = os.path.join(res, f"s4-{mode}.json")
        if os.path.exists(p):
            b = json.load(open(p))
            data[f"bounce_{mode}"] = b
            lines.append(("4", f"inode bounced n1<->n2, {what}: p99 ms",
                          f"p50 {b['p50_us'] / 1000:.2f} / p99 {b['p99_us'] / 1000:.2f} / max {b['max_us'] / 1000:.1f} ms",
                          b["p99_us"] / 1000, "< 20 ms" if mode == "utime" else "(context)",
                          b["p99_us"] < 20000 if mode == "utime" else None))
    # §5 SIGKILL
    p = os.path.join(res, "s5.json")
    if os.path.exists(p):
        k = json.load(open(p))
        per = {}
        worst = 0
        total = 0
        for node in (2, 3):
            logs = glob.glob(os.path.join(res, f"s5.node{node}_iops.*.log"))
            if not logs:
                per[node] = None
                continue
            rows = iops_log(logs[0])
            z, longest, start = zero_runs(rows, k["runtime_s"])
            vals = [v for _, v in rows]
            per[node] = {"zero_seconds": z, "longest_zero_run_s": longest, "run_start_s": start,
                         "seconds_logged": len(rows), "min_iops": min(vals) if vals else None,
                         "median_iops": sorted(vals)[len(vals) // 2] if vals else None}
            worst, total = max(worst, longest), total + z
        k["per_node"] = per
        g = fio_group(res, "s5")
        k["iops"] = g["iops"] if g else None
        data["sigkill"] = k
        ok = all(v is not None for v in per.values()) and total == 0
        desc = "; ".join(
            f"n{n}: {v['zero_seconds']} zero s, longest {v['longest_zero_run_s']}"
            + (f" from t={v['run_start_s']:.0f}s" if v["longest_zero_run_s"] else "")
            if v else f"n{n}: no iops log" for n, v in per.items())
        lines.append(("5", "n1 SIGKILLed: longest 0-IOPS run n2/n3, s", desc, worst, "none", ok))

    # ---- print ---------------------------------------------------------------------------------
    print()
    print(f"bench/cluster.sh results ({meta['stamp']}, commit {meta['commit']}, {meta['cpus']} CPUs, "
          f"load {meta['load']}); {meta['runtime']} s per fio job, images {meta['size']}, "
          f"LUN: {meta['lun_kind']}")
    print(f"volume made with {meta['timings']}")
    w = max(len(x[1]) for x in lines) if lines else 40
    print()
    mw = max([len(x[2]) for x in lines] + [8])
    print(f"{'#':<2} {'what':<{w}}  {'measured':<{mw}}  {'value':>6}  {'target':<9} result")
    print("-" * (w + mw + 35))
    for sec, what, meas, val, tgt, ok in lines:
        print(f"{sec:<2} {what:<{w}}  {meas:<{mw}}  {f(val, '.2f'):>6}  {tgt:<9} {mark(ok)}")
    print("value: the ratio (or ops/s, ms, seconds) the target is about; n1..n3 = node1..node3")

    print("\ncontext:")
    for n in ("1", "3"):
        d = data.get(f"randwrite_{n}node")
        if not d:
            continue
        rfr, rpre = d["raw_fresh"], d["raw_prefilled"]
        print(f"  randwrite {n} node(s): CetraFS fresh {f(d['fresh']['iops'])} IOPS (p99 {f(d['fresh']['p99_us'])} us, "
              f"per node {d['fresh']['per_node']}), prefilled {f(d['prefilled']['iops'])} (p99 {f(d['prefilled']['p99_us'])} us)")
        if rfr and rpre:
            print(f"      raw LUN file: fresh sparse {f(rfr['iops'])} IOPS (p99 {f(rfr['p99_us'])} us), prefilled "
                  f"{f(rpre['iops'])} (p99 {f(rpre['p99_us'])} us); CetraFS/raw: fresh "
                  f"{f(ratio(d['fresh']['iops'], rfr['iops']), '.2f')}, prefilled {f(ratio(d['prefilled']['iops'], rpre['iops']), '.2f')}")
    rr = fio_group(res, "raw-read2")
    for p, key2, label in (("s2", "read_under_load", ""), ("s2p", "read_under_load_pinned", " (pinned)")):
        d = data.get(key2)
        if not d:
            continue
        print(f"  randread nodes 2+3{label}: (a) idle {f(d['idle']['iops'])} IOPS p50/p99 {f(d['idle']['p50_us'])}/{f(d['idle']['p99_us'])} us"
              + (f"; raw LUN file, 2 processes: {f(rr['iops'])} IOPS p50/p99 {f(rr['p50_us'])}/{f(rr['p99_us'])} us" if rr and not label else ""))
        rb, rbw = fio_group(res, "raw-read2-b"), fio_group(res, "raw-write-bg")
        if rr and rb and rbw and not label:
            print(f"      raw context for (b): the 2 raw readers while a third process randwrites a fresh sparse file at "
                  f"{f(rbw['iops'])} IOPS: {f(rb['iops'])} IOPS = {f(ratio(rb['iops'], rr['iops']), '.2f')} of raw idle, "
                  f"p99 {f(rb['p99_us'])} us = {f(ratio(rb['p99_us'], rr['p99_us']), '.2f')}x")
        for key in ("write", "create"):
            g = d.get(key)
            if g:
                print(f"      ({'b' if key == 'write' else 'c'}) {f(g['iops'])} IOPS p50/p99 {f(g['p50_us'])}/{f(g['p99_us'])} us, per node {g['per_node']}")
        bg = fio_group(res, f"{p}-write-bg")
        if bg:
            print(f"      node 1's fresh-image randwrite during (b): {f(bg['iops'])} IOPS")
        bgc = meta_group(res, f"{p}-create-bg")
        if bgc:
            print(f"      node 1's creates during (c): {f(bgc['rate'])} files/s")
        g, bgo = d.get("over"), fio_group(res, f"{p}-over-bg")
        if g and bgo:
            print(f"      (d) context, node 1 randwrites its prefilled image at {f(bgo['iops'])} IOPS (no metadata, no locks): "
                  f"{f(g['iops'])} IOPS = {f(g['iops_ratio'], '.2f')} of (a), p99 {f(g['p99_us'])} us = {f(g['p99_ratio'], '.2f')}x")
    d = data.get("meta_ops")
    if d:
        for key in ("one", "private", "shared"):
            g = d.get(key)
            if g:
                print(f"  meta ops {key:<8}: {f(g['rate'])} ops/s, per node {g['per_node']}, worst per-node op p99 {f(g['p99_us'])} us")
    k = data.get("sigkill")
    if k:
        print(f"  SIGKILL: readers ran {k['runtime_s']} s, node1 killed {k['kill_at_s']:.1f} s after they started; "
              f"nodes 2+3 read {f(k.get('iops'))} IOPS over the run")
        for n, v in k["per_node"].items():
            if v:
                print(f"      node{n}: per-second IOPS median {f(v['median_iops'])}, lowest logged {f(v['min_iops'])}, "
                      f"{v['zero_seconds']} of {k['runtime_s']} s without a completion")
        for line in k.get("recovery_log", []):
            print(f"      {line}")
    allocs = os.path.join(res, "fresh-alloc.txt")
    if os.path.exists(allocs):
        print("  fresh images after their run (allocated / written by fio in the measured window, MiB):")
        for line in open(allocs):
            print(f"      {line.rstrip()}")
    cpu = os.path.join(res, "cpu.txt")
    if os.path.exists(cpu):
        print("  daemon CPU (% of one core, per node, over the phase):")
        for line in open(cpu):
            print(f"      {line.rstrip()}")

    json.dump({"run": meta, "results": data,
               "lines": [{"section": s, "what": w_, "measured": m, "value": v, "target": t, "result": mark(o)}
                         for s, w_, m, v, t, o in lines],
               "host": {"kernel": platform.release(), "cpus": os.cpu_count()}},
              open(a.out, "w"), indent=2)
    print(f"\nPASS/MISS are against issue 9's targets; the exit status says only whether the run worked. JSON: {a.out}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("meta")
    m.add_argument("--dir", required=True)
    m.add_argument("--seconds", type=float, required=True)
    m.add_argument("--start", type=float, default=0)
    m.add_argument("--mode", choices=("cru", "create"), default="cru")
    m.add_argument("--tag", required=True)
    m.add_argument("--out", required=True)
    b = sub.add_parser("bounce")
    b.add_argument("--a", required=True)
    b.add_argument("--b", required=True)
    b.add_argument("--count", type=int, default=200)
    b.add_argument("--mode", choices=("utime", "write"), default="utime")
    b.add_argument("--out", required=True)
    r = sub.add_parser("report")
    r.add_argument("results")
    r.add_argument("out")
    a = ap.parse_args()
    {"meta": cmd_meta, "bounce": cmd_bounce, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
