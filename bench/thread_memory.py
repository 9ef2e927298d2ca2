#!/usr/bin/env python3
"""Resident memory of a running mount-cetra daemon's threads: their stacks and the FUSE
workers' request buffers (the "threads' term" of bench/stat-tree.sh's memory budget, see
docs/performance.md §6a). Run as root (it reads /proc/PID/pagemap, task/*/syscall and fd/*).

  thread_memory.py PID STATE_FILE

prints one JSON object: {"kib": stacks + buffers, "summary" (one line), "stacks_kib", "buffers_kib", "threads",
"stacks", "workers", "buffers", "unattributed": [names of threads whose memory could not be
attributed]}. Nothing is estimated: memory is attributed to a thread only where its address
range is known exactly; what is not attributed is not in "kib", so it counts against the
caches' budget.

How each range is found, whatever the kernel merged (it merges adjacent anonymous mappings with
the same flags into one, so several 16 MiB request buffers, or a buffer and a heap chunk
allocated with mmap, show as one mapping in smaps):

* A FUSE worker's request buffer: fuser 0.18 reads every request into one buffer per worker
  (allocated once, never moved or freed while mounted). An idle worker is blocked in read(2)
  on its /dev/fuse descriptor, and /proc/PID/task/TID/syscall shows that read's buffer address
  and length. The range is those bytes widened to whole pages (that covers the malloc chunk
  header, which shares the first page). Addresses seen once are kept in STATE_FILE, so a
  worker busy at the moment is still counted; a worker never seen idle is unattributed.
* A thread's stack: the mapping that holds the thread's stack pointer (from the same file),
  if that mapping sits right above a PROT_NONE guard page (a pthread stack, which the kernel
  never merges downwards, and on current kernels never with non-stack mappings: MAP_STACK
  sets VM_NOHUGEPAGE), holds no other thread's stack pointer and overlaps no request buffer;
  or the main thread's [stack]. A thread never seen blocked is unattributed.

Resident pages are counted per page from /proc/PID/pagemap (present, and not the shared zero
page, which VmRSS does not count either), so a range is measured exactly even when it is
part of a bigger mapping.
"""
import ctypes
import json
import mmap
import os
import platform
import struct
import sys
import time

PAGE = os.sysconf("SC_PAGE_SIZE")
# read(2)'s syscall number, as /proc/PID/task/TID/syscall shows it.
READ_NR = {"x86_64": 0, "aarch64": 63, "riscv64": 63}
PRESENT = 1 << 63
PFN_MASK = (1 << 55) - 1


def mappings(pid):
    out = []
    for line in open(f"/proc/{pid}/maps"):
        f = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in f[0].split("-"))
        out.append((start, end, f[1], f[5].strip() if len(f) > 5 else ""))
    return out


def zero_pfn():
    """The page frame of the kernel's shared zero page: what a read-only touch of fresh
    anonymous memory maps (pagemap says present; RSS does not count it)."""
    m = mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _ = m[0]
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // PAGE * 8)
        (e,) = struct.unpack("<Q", f.read(8))
    return e & PFN_MASK if e & PRESENT else None


def resident_kib(pagemap, start, end, zpfn):
    first, last = start // PAGE, (end + PAGE - 1) // PAGE
    pagemap.seek(first * 8)
    data = pagemap.read((last - first) * 8)
    n = 0
    for (e,) in struct.iter_unpack("<Q", data):
        if e & PRESENT and (e & PFN_MASK) != zpfn:
            n += 1
    return n * PAGE >> 10


def tasks(pid):
    """{tid: (name, syscall fields or None if running)}"""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            sc = open(f"/proc/{pid}/task/{tid}/syscall").read().split()
        except OSError:
            continue  # the thread ended
        out[tid] = (name, None if sc[0] == "running" else sc)
    return out


def fuse_read(pid, sc, read_nr):
    """(address, length) of the buffer of a read(2) on /dev/fuse, else None."""
    if int(sc[0]) != read_nr:
        return None
    try:
        fd = int(sc[1], 16)
        if os.readlink(f"/proc/{pid}/fd/{fd}") != "/dev/fuse":
            return None
    except (OSError, ValueError):
        return None
    return int(sc[2], 16), int(sc[3], 16)


def main():
    pid, state_file = sys.argv[1], sys.argv[2]
    read_nr = READ_NR.get(platform.machine())
    if read_nr is None:
        sys.exit(f"thread_memory: read(2)'s syscall number on {platform.machine()} is not known")
    try:
        buffers = {t: tuple(r) for t, r in json.load(open(state_file)).items()}
    except FileNotFoundError:
        buffers = {}
    # Threads are sampled until every one is blocked (an idle daemon's threads all are), for
    # up to 5 s; one still running then is unattributed.
    for _ in range(50):
        ts = tasks(pid)
        for tid, (name, sc) in ts.items():
            if sc is not None and len(sc) > 3:
                r = fuse_read(pid, sc, read_nr)
                if r:
                    buffers[tid] = r
        workers = [t for t, (n, _) in ts.items() if n.startswith("fuser-")]
        if all(sc is not None for _, sc in ts.values()) and all(t in buffers for t in workers):
            break
        time.sleep(0.1)
    buffers = {t: r for t, r in buffers.items() if t in ts}
    json.dump(buffers, open(state_file, "w"))

    maps = mappings(pid)
    zpfn = zero_pfn()
    ranges = {t: (a // PAGE * PAGE, (a + n + PAGE - 1) // PAGE * PAGE) for t, (a, n) in buffers.items()}
    unattributed = [ts[t][0] for t in workers if t not in buffers]
    sps = {t: int(sc[-2], 16) for t, (_, sc) in ts.items() if sc is not None}
    unattributed += [ts[t][0] for t in ts if t not in sps]
    stacks = {}
    for tid, sp in sps.items():
        i = next((i for i, (s, e, _, _) in enumerate(maps) if s <= sp < e), None)
        ok = False
        if i is not None:
            s, e, perms, name = maps[i]
            guarded = i > 0 and maps[i - 1][1] == s and maps[i - 1][2].startswith("---")
            alone = sum(s <= p < e for p in sps.values()) == 1
            clear = not any(bs < e and s < be for bs, be in ranges.values())
            ok = perms.startswith("rw") and alone and clear and (name == "[stack]" or (name == "" and guarded))
        if ok:
            stacks[tid] = (s, e)
        else:
            unattributed.append(ts[tid][0])
    with open(f"/proc/{pid}/pagemap", "rb") as pm:
        stacks_kib = sum(resident_kib(pm, s, e, zpfn) for s, e in stacks.values())
        buffers_kib = sum(resident_kib(pm, s, e, zpfn) for s, e in ranges.values())
    unattributed.sort()
    print(json.dumps({
        "kib": stacks_kib + buffers_kib,
        "summary": f"{stacks_kib} KiB in {len(stacks)} of {len(ts)} stacks, {buffers_kib} KiB in "
        f"{len(ranges)} of {len(workers)} request buffers; unattributed (counted against the "
        f"budget): {', '.join(unattributed) or 'none'}",
        "stacks_kib": stacks_kib,
        "buffers_kib": buffers_kib,
        "threads": len(ts),
        "stacks": len(stacks),
        "workers": len(workers),
        "buffers": len(ranges),
        "unattributed": unattributed,
    }))


if __name__ == "__main__":
    main()
