#!/bin/sh
# /bin/san-node in the multi-host harness's initiator guests (busybox sh): the steps
# tests/lio/san asks a node to take, so that the host side sends one short command each.
#   san-node login IQN PORTAL...    add a node record per portal, log in to all, start
#                                   multipathd, wait until the maps of both LUNs have 2 paths
#   san-node map SERIAL             the name of the dm-multipath map whose paths carry SERIAL
#   san-node paths MAP              how many paths MAP has, and their states (multipathd's view)
#   san-node mount MAP HOST [OPTS]  start mount.cetra on /mnt/cetra (log /tmp/cetra.log; an
#                                   earlier mount's log is kept as /tmp/cetra.log.1, .2, ...)
#                                   and wait (90 s) until it is mounted
#   san-node umount                 unmount and wait until the daemon exited (its exit status)
#   san-node kill                   SIGKILL the daemon and detach its mount (umount -l)
#   san-node writer NAME MB         background, two loops: one writes /mnt/cetra/NAME (MB MiB,
#                                   O_DIRECT, 1 MiB at a time, then fdatasync) over and over, a line
#                                   per pass ("ok" or "ERROR", uptime) in /tmp/writer-NAME.log;
#                                   the other creates, fsyncs, renames and removes a file in
#                                   /mnt/cetra/NAME.d (metadata: locks, journal) over and over,
#                                   likewise in /tmp/meta-NAME.log
#   san-node stop-writer NAME       stop both; prints passes and errors of each, and the longest
#                                   time between two completed passes (s); then the first errors,
#                                   the loops' slow steps and the daemon's slow requests (5 s or
#                                   more) meanwhile
set -u
M=/mnt/cetra
die() { echo "san-node: $*" >&2; exit 1; }
cmd=${1:-}; [ $# -gt 0 ] && shift
case $cmd in
login)
    iqn=$1; shift
    for p in "$@"; do iscsiadm -m node -o new -T "$iqn" -p "$p" > /dev/null || die "node record $p"; done
    iscsiadm -m node -T "$iqn" -L all || die "login"
    udevadm settle -t 30
    multipathd || die "multipathd"
    i=0
    while [ $i -lt 60 ]; do
        n=0
        for d in /sys/block/dm-*; do [ -d "$d" ] && [ "$(ls "$d/slaves" | wc -l)" = 2 ] && n=$((n + 1)); done
        [ $n -ge 2 ] && break
        sleep 1; i=$((i + 1))
    done
    udevadm settle -t 30
    multipath -ll
    ;;
map)
    for d in /sys/block/dm-*; do
        s=$(ls "$d/slaves" | head -1)
        [ -n "$s" ] && grep -q "$1" "/sys/block/$s/device/vpd_pg80" 2>/dev/null && cat "$d/dm/name"
    done
    ;;
paths)
    for d in /sys/block/dm-*; do
        [ "$(cat "$d/dm/name")" = "$1" ] && ls "$d/slaves" | wc -l
    done
    multipathd show paths raw format "%d %t %T" 2>/dev/null | tr '\n' ';'; echo
    ;;
mount)
    map=$1; host=$2; opts=${3:-}
    [ -b /dev/mapper/$map ] || die "/dev/mapper/$map is not a block device"
    mkdir -p $M
    if [ -e /tmp/cetra.log ]; then
        k=1; while [ -e /tmp/cetra.log.$k ]; do k=$((k + 1)); done; mv /tmp/cetra.log /tmp/cetra.log.$k
    fi
    CETRA_LOG_FILE=/tmp/cetra.log setsid mount.cetra /dev/mapper/$map $M -o host=$host${opts:+,$opts} > /tmp/mount.out 2>&1 < /dev/null &
    i=0
    while ! grep -q " $M fuse" /proc/mounts; do
        i=$((i + 1)); [ $i -lt 90 ] || { tail -5 /tmp/cetra.log /tmp/mount.out; die "not mounted after 90 s"; }
        sleep 1
    done
    grep -m1 -o 'multipath map [^)]*)' /tmp/cetra.log
    grep -m1 -o 'COMPARE AND WRITE via [^;]*' /tmp/cetra.log
    grep -m1 -o 'fence=[a-z]*: [^.]*' /tmp/cetra.log
    ;;
umount)
    pid=$(pidof mount.cetra)
    umount $M || die "umount"
    i=0
    while [ -n "$pid" ] && [ -d /proc/$pid ]; do
        i=$((i + 1)); [ $i -lt 300 ] || die "daemon $pid still running 60 s after umount"
        sleep 0.2
    done
    ;;
kill)
    kill -9 $(pidof mount.cetra) 2>/dev/null
    sleep 0.5
    umount -l $M
    ;;
writer)
    name=$1; mb=$2
    rm -f /tmp/writer-$name.stop
    # where the daemon's log stood: stop-writer reports the slow requests logged since
    wc -l < /tmp/cetra.log > /tmp/writer-$name.logpos
    mkdir -p $M/$name.d
    # loop KIND COMMAND: run COMMAND (with $pass set) until the stop file exists; a line per pass
    # in /tmp/KIND-NAME.log, its pid in /tmp/KIND-NAME.pid
    loop() {
        (
            pass=0
            while [ ! -e /tmp/writer-$name.stop ]; do
                pass=$((pass + 1))
                if eval "$2" 2> /tmp/$1-$name.err; then
                    echo "pass $pass ok $(cut -d' ' -f1 /proc/uptime)"
                else
                    echo "pass $pass ERROR $(cut -d' ' -f1 /proc/uptime): $(tail -1 /tmp/$1-$name.err)"; sleep 0.5
                fi
            done
        ) > /tmp/$1-$name.log 2>&1 < /dev/null &
        echo $! > /tmp/$1-$name.pid
    }
    # st STEP CMD...: run CMD; one that took 5 s or more is named in the loop's log (a stall
    # the daemon does not see as one slow request: several shorter ones, or one in the kernel)
    st() {
        n=$1; shift
        a=$(cut -d' ' -f1 /proc/uptime)
        "$@" || return 1
        awk -v a="$a" -v b="$(cut -d' ' -f1 /proc/uptime)" -v n="$n" \
            'BEGIN { if (b - a >= 5) printf "slow step: %s took %.1f s from uptime %.1f\n", n, b - a, a }'
    }
    # a VM's writes: O_DIRECT, flushed with fdatasync as QEMU does for a cache=none image
    # (busybox dd has no conv=fdatasync: `sync -d` is one)
    loop writer 'st write dd if=/dev/urandom of=$M/$name bs=1M count="$mb" oflag=direct conv=notrunc && st fdatasync sync -d $M/$name'
    loop meta 'f=$M/$name.d/f$pass; st create sh -c "echo $pass > $f" && st fsync sync $f && st rename mv $f $f.x && st unlink rm $f.x'
    ;;
stop-writer)
    touch /tmp/writer-$1.stop
    for w in writer meta; do
        pid=$(cat /tmp/$w-$1.pid)
        i=0
        # the loop ends after its current pass
        while [ -d /proc/$pid ]; do
            i=$((i + 1)); [ $i -lt 600 ] || { echo "$w $1 still running after 120 s"; break; }
            sleep 0.2
        done
        gap=$(awk '/ ok /{ if (p) { d = $4 - p; if (d > m) m = d } p = $4 } END { printf "%.1f", m }' /tmp/$w-$1.log)
        echo "$w: passes $(grep -c ' ok ' /tmp/$w-$1.log) errors $(grep -c ERROR /tmp/$w-$1.log) longest gap $gap s"
    done
    grep -h ERROR /tmp/writer-$1.log /tmp/meta-$1.log | head -3
    for w in writer meta; do grep -o 'slow step: .*' /tmp/$w-$1.log | sed "s/^slow step: /slow step: $w /" | tail -4; done
    # the daemon's slow requests meanwhile (adapter.rs `Timed`): which operation waited
    tail -n +$(($(cat /tmp/writer-$1.logpos) + 1)) /tmp/cetra.log | grep -o 'slow request: .*' | tail -8
    ;;
*) die "unknown command '$cmd'" ;;
esac
