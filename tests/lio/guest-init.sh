#!/bin/sh
# /init of the LIO test guest (busybox sh). Sets up LIO purely through configfs, exports the
# backstores through tcm_loop as local SCSI disks, runs /bin/lio-check, then mkfs.cetra,
# fsck.cetra and mount.cetra on those disks, then the multi-node file system scenarios
# (lio-check fs-multi: three mount.cetra daemons on three nexuses of one LUN), and powers off.
# Results go to the second serial port (/dev/ttyS1 -> host file results.log), kernel noise
# stays on ttyS0 (console.log).
# Kernel command line knobs: lio.size=64M  lio.cawtotal=10200  lio.paths=3  lio.stall=0
#   lio.multinode=1 lio.mninterval=200 lio.mniotimeout=1000 lio.mnfiles=50 (fs-multi scenarios)
#   lio.prabort=0 (1: the pr check also runs PREEMPT AND ABORT, which deadlocks Debian's LIO (6.1 and 6.12))
#   lio.iscsi=1 (the guest also logs in three times to its own LIO iSCSI target and runs the
#   pr check and lio-check fence with PREEMPT AND ABORT over those three iSCSI sessions; 0: not)
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
exec </dev/console >/dev/console 2>&1
R=/dev/ttyS1
say() { echo "lio-guest: $*"; echo "GUEST $*" > $R; }
die() { say "FATAL: $*"; dmesg | tail -30 > $R; echo "LIO-CHECK-RESULT FAIL (guest setup: $*)" > $R; sync; poweroff -f; sleep 5; }

SIZE=64M; CAWTOTAL=10200; NPATHS=3; STALLTEST=0
MULTINODE=1; MNINTERVAL=200; MNIOTIMEOUT=1000; MNFILES=50; PRABORT=0; ISCSI=1
for a in $(cat /proc/cmdline); do
    case $a in
        lio.size=*) SIZE=${a#*=} ;;
        lio.cawtotal=*) CAWTOTAL=${a#*=} ;;
        lio.paths=*) NPATHS=${a#*=} ;;
        lio.stall=*) STALLTEST=${a#*=} ;;
        lio.multinode=*) MULTINODE=${a#*=} ;;
        lio.mninterval=*) MNINTERVAL=${a#*=} ;;
        lio.mniotimeout=*) MNIOTIMEOUT=${a#*=} ;;
        lio.mnfiles=*) MNFILES=${a#*=} ;;
        lio.prabort=*) PRABORT=${a#*=} ;;
        lio.iscsi=*) ISCSI=${a#*=} ;;
    esac
done
# How the multi-node daemons (fence=auto/pr) remove a dead node's reservation key.
if [ "$PRABORT" = 1 ]; then PREEMPT=abort; else PREEMPT=plain; fi
case $SIZE in
    *[mM]) BYTES=$(( ${SIZE%?} * 1024 * 1024 )) ;;
    *[gG]) BYTES=$(( ${SIZE%?} * 1024 * 1024 * 1024 )) ;;
    *) BYTES=$SIZE ;;
esac
say "booted in $(cut -d' ' -f1 /proc/uptime)s, $(nproc) vCPU(s)"

# LIO's db_root must exist before target_core_mod loads (PR/ALUA metadata live there).
mkdir -p /etc/target/pr /etc/target/alua
while read -r ko; do
    # the iSCSI target and initiator modules only when they are used
    case $ko in *iscsi*) [ "$ISCSI" = 1 ] || continue ;; esac
    insmod "$ko" 2>/dev/null || echo "insmod $ko failed (ignored)"
done < /etc/modules.order
mount -t configfs configfs /sys/kernel/config || die "configfs"
T=/sys/kernel/config/target
[ -d $T/core ] || die "target_core_mod not loaded"
mkdir -p /srv && mount -t tmpfs -o size=$((BYTES * 5)),mode=0700 srv /srv

# backstore NAME BLOCK_SIZE ATTRS...: sparse fileio file on tmpfs. Attributes go AFTER enable
# (emulate_tpu before enable oopses 6.1 in fd_configure_unmap) and BEFORE any LUN link
# (block_size cannot change once exported).
backstore() {
    name=$1; shift
    truncate -s "$BYTES" /srv/$name.img
    D=$T/core/fileio_0/$name; mkdir -p $D || die "mkdir $D"
    echo "fd_dev_name=/srv/$name.img,fd_dev_size=$BYTES,fd_buffered_io=1" > $D/control || die "control $name"
    echo "cetrafs-$name" > $D/wwn/vpd_unit_serial || die "serial $name"
    echo 1 > $D/enable || die "enable $name"
    for kv in "$@"; do echo "${kv#*=}" > "$D/attrib/${kv%%=*}" || die "attrib $name $kv"; done
}
backstore d512 block_size=512 emulate_tpu=1
backstore d4k block_size=4096 emulate_tpu=1
backstore nocaw block_size=512 emulate_caw=0

# export LUN: one tcm_loop target (= one SCSI host, one I_T nexus) per call. Several targets
# linking the same backstore are several initiators (nexuses) to one LUN. The new sg/sd
# nodes are found by diffing /sys/class/scsi_generic before and after the link.
N=0
export_lun() {
    bs=$1; N=$((N + 1))
    LT=$T/loopback/naa.50014050000000$(printf %02x $N)/tpgt_1
    before=$(ls /sys/class/scsi_generic 2>/dev/null | tr '\n' ' ')
    # nexus first: the LUN link calls scsi_add_device, which needs the I_T nexus
    mkdir -p $LT || die "mkdir $LT"
    echo naa.50014050000001$(printf %02x $N) > $LT/nexus || die "nexus $N"
    BSD=$(ls -d $T/core/*/$bs | head -1)
    mkdir $LT/lun/lun_0 && ln -s $BSD $LT/lun/lun_0/$bs || die "link $bs"
    i=0; SG=
    while [ $i -lt 200 ]; do
        for s in $(ls /sys/class/scsi_generic); do
            case " $before " in *" $s "*) ;; *) SG=$s ;; esac
        done
        [ -n "$SG" ] && [ -d /sys/class/scsi_generic/$SG/device/block ] && break
        sleep 0.05; i=$((i + 1))
    done
    [ -n "$SG" ] || die "no sg node for $bs (nexus $N)"
    SD=$(ls /sys/class/scsi_generic/$SG/device/block | head -1)
    [ -b /dev/$SD ] && [ -c /dev/$SG ] || die "device nodes for $bs missing ($SG/$SD)"
    say "nexus $N: $bs -> /dev/$SG /dev/$SD ($(cat /sys/class/scsi_generic/$SG/device/vendor) $(cat /sys/class/scsi_generic/$SG/device/model))"
    LAST_SG=/dev/$SG; LAST_SD=/dev/$SD
}
export_lun d512; D512=$LAST_SG; D512SD=$LAST_SD; PATHS=$LAST_SG; D512SDS=$LAST_SD
p=1; while [ $p -lt "$NPATHS" ]; do export_lun d512; PATHS="$PATHS,$LAST_SG"; D512SDS="$D512SDS,$LAST_SD"; p=$((p + 1)); done
# d4k through as many nexuses too: the multi-node file system scenarios run on both LUNs
export_lun d4k; D4K=$LAST_SG; D4KSD=$LAST_SD; D4KSDS=$LAST_SD
p=1; while [ $p -lt "$NPATHS" ]; do export_lun d4k; D4KSDS="$D4KSDS,$LAST_SD"; p=$((p + 1)); done
export_lun nocaw; NOCAW=$LAST_SG; NOCAWSD=$LAST_SD
# stall LUN (opt-in, lio.stall=1): iblock on dm-linear over /dev/ram0 (brd). `dmsetup suspend`
# queues its I/O, so a CAW sent meanwhile outlives its SG_IO timeout: the outcome-unknown path.
# Opt-in because Debian's 6.1.192 LIO oopses when the aborted CAW completes after resume
# (list_add corruption in target_cmd_interrupted <- iblock_complete_cmd), see tests/lio/README.md.
STALL=
if [ "$STALLTEST" = 1 ] && [ -b /dev/ram0 ] && echo "0 $(cat /sys/block/ram0/size) linear /dev/ram0 0" | dmsetup --noudevsync create stall; then
    DM=$(for d in /sys/block/dm-*; do [ "$(cat $d/dm/name)" = stall ] && basename $d; done)
    D=$T/core/iblock_0/stall; mkdir -p $D || die "mkdir $D"
    echo "udev_path=/dev/$DM" > $D/control && echo "cetrafs-stall" > $D/wwn/vpd_unit_serial &&
        echo 1 > $D/enable || die "iblock stall"
    export_lun stall; STALL="--stall $LAST_SG --stall-dm stall"
else
    [ "$STALLTEST" = 1 ] && say "no brd/dm-mod: stall test skipped"
fi
say "LIO ready at $(cut -d' ' -f1 /proc/uptime)s; memory $(free -m | awk '/Mem:/{print "total="$2"M used="$3"M"}')"
echo "LIO-READY"

# lio-check all: conformance on d512/d4k, CAW contention and then the persistent reservation
# check (`pr`: register/reserve/RESERVATION CONFLICT/PREEMPT AND ABORT, ends with CLEAR) on the
# d512 nexuses in $PATHS, the no-CAW LUN, the stall LUN.
/bin/lio-check all --d512 $D512 --d512-sd $D512SD --d4k $D4K --d4k-sd $D4KSD \
    --paths "$PATHS" --nocaw $NOCAW --size $BYTES --caw-total $CAWTOTAL --pr-abort $PRABORT $STALL > $R 2>&1
rc=$?
say "lio-check exit $rc at $(cut -d' ' -f1 /proc/uptime)s"

# ---- the real binaries on the tcm_loop disks: open_lun's device selection, mkfs's and
# mount's COMPARE AND WRITE probe, refusals (no CAW, partition), fsck through sd and sg nodes.
# Lines: "PASS tools NAME: ..." / "FAIL tools NAME: ...", command output as "OUT NAME: ...".
# The daemon's log must hold no ERROR line and no panic (lio-check daemon-log).
TP=0; TF=0
up() { cut -d' ' -f1 /proc/uptime; }
tpass() { TP=$((TP + 1)); echo "PASS tools $*" > $R; }
tfail() { TF=$((TF + 1)); echo "FAIL tools $*" > $R; }
# expect NAME RC TEXT CMD...: CMD must exit with RC and print TEXT (fixed string)
expect() {
    name=$1; want=$2; text=$3; shift 3
    t0=$(up)
    out=$("$@" 2>&1); rc=$?
    dt=$(awk -v a="$t0" -v b="$(up)" 'BEGIN{printf "%.2f", b-a}')
    echo "$out" | sed "s|^|OUT $name: |" > $R
    if [ "$rc" = "$want" ] && echo "$out" | grep -q -F -- "$text"; then
        tpass "$name: exit $rc, printed '$text' (${dt}s)"
    else
        tfail "$name: exit $rc (want $want), '$text' $(echo "$out" | grep -q -F -- "$text" && echo printed || echo 'NOT printed') (${dt}s)"
    fi
}
MULTI="sharing:            multi-node (SCSI COMPARE AND WRITE verified)"
NOCAWMSG="refused for multi-node use: this LUN has no working SCSI COMPARE AND WRITE"
MKFS="mkfs.cetra -f -N 2 --journal-size 4M"
for lun in "d512 $D512SD $D512" "d4k $D4KSD $D4K"; do
    set -- $lun
    expect "mkfs $1 $2" 0 "$MULTI" $MKFS -L "$1" "$2"
    expect "fsck $1 $2" 0 "$2: clean" fsck.cetra -n "$2"
    # the sg node of the same LUN: all I/O through SG_IO
    expect "fsck $1 $3 (sg)" 0 "$3: clean" fsck.cetra -n "$3"
done
# a /dev/disk/by-id style symlink to the sd node (no udev in the guest: made by hand)
mkdir -p /dev/disk/by-id && ln -sf "$D4KSD" /dev/disk/by-id/scsi-cetrafs-d4k
expect "fsck by-id link" 0 "/dev/disk/by-id/scsi-cetrafs-d4k: clean" fsck.cetra -n /dev/disk/by-id/scsi-cetrafs-d4k
# a LUN without COMPARE AND WRITE: refused before anything is written
before=$(dd if=$NOCAWSD bs=1M count=2 2>/dev/null | md5sum)
expect "mkfs nocaw $NOCAWSD" 1 "$NOCAWMSG" $MKFS "$NOCAWSD"
after=$(dd if=$NOCAWSD bs=1M count=2 2>/dev/null | md5sum)
if [ "$before" = "$after" ]; then tpass "mkfs nocaw left the first 2 MiB unchanged"; else tfail "mkfs nocaw changed the first 2 MiB"; fi
# a partition of a LUN (busybox fdisk: new DOS label, one primary partition, write + BLKRRPART)
printf 'o\nn\np\n1\n\n\nw\n' | fdisk "$NOCAWSD" > /tmp/fdisk.out 2>&1
i=0; while [ ! -b "${NOCAWSD}1" ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
if [ -b "${NOCAWSD}1" ]; then
    expect "mkfs partition ${NOCAWSD}1" 1 "is partition 1 of $(basename $NOCAWSD): CetraFS needs the whole LUN" $MKFS "${NOCAWSD}1"
    expect "fsck partition ${NOCAWSD}1" 8 "is partition 1 of" fsck.cetra -n "${NOCAWSD}1"
else
    sed 's|^|OUT fdisk: |' /tmp/fdisk.out > $R
    tfail "no partition ${NOCAWSD}1 after fdisk"
fi
# mount.cetra on the 512 LUN: probe at mount, write a file, unmount, fsck sees it
if [ -c /dev/fuse ]; then
    mkdir -p /mnt/c
    export CETRA_LOG_FILE=/tmp/mount.log
    hostname lio-guest
    expect "mount $D512SD" 0 "" mount.cetra "$D512SD" /mnt/c -o host=lio-guest
    if grep -q -F "$D512SD: SCSI disk" /tmp/mount.log && grep -q -F "multi-node (SCSI COMPARE AND WRITE verified)" /tmp/mount.log; then
        tpass "mount.cetra probed COMPARE AND WRITE: $(grep -F 'multi-node' /tmp/mount.log | tail -1 | cut -c1-200)"
    else
        sed 's|^|OUT mount.log: |' /tmp/mount.log > $R; tfail "mount.cetra did not log the COMPARE AND WRITE probe"
    fi
    echo "written through mount.cetra on $D512SD" > /mnt/c/hello && sync
    got=$(cat /mnt/c/hello 2>&1)
    if [ "$got" = "written through mount.cetra on $D512SD" ]; then tpass "file written and read back through FUSE"; else tfail "read back: $got"; fi
    umount /mnt/c || tfail "umount /mnt/c"
    i=0; while pidof mount.cetra >/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    pidof mount.cetra >/dev/null && tfail "mount.cetra still running 10s after umount"
    expect "fsck after mount $D512SD" 0 "1 files" fsck.cetra -n "$D512SD"
    # the daemon's whole log: no ERROR line, no panic (lio-check daemon-log prints the line)
    lio-check daemon-log --tag tools --name "mount.cetra log has no ERROR line" --log /tmp/mount.log > /tmp/dlog.out 2>&1
    rc=$?
    cat /tmp/dlog.out > $R
    if [ "$rc" = 0 ]; then
        TP=$((TP + 1))
    else
        TF=$((TF + 1)); grep -q '^FAIL ' /tmp/dlog.out || echo "FAIL tools daemon-log: lio-check exit $rc" > $R
        sed 's|^|OUT mount.log: |' /tmp/mount.log > $R
    fi
else
    tfail "no /dev/fuse in the guest (fuse.ko missing from base.cpio?)"
fi
say "tools checks done at $(up)s"

# ---- cetra grow on a SCSI LUN (issue 11): an iblock backstore on dm-linear over RAM disks
# 1..15 of brd (4 MiB each; ram0 is the stall test's), exported through tcm_loop. The table
# grows from 10 to 15 disks (40 -> 60 MiB): LIO's iblock reports the new capacity at once
# (READ CAPACITY through SG_IO), the kernel's sd node only after a rescan. Before the rescan
# `cetra grow` is refused (the data path goes through sd), after it the volume grows online,
# takes a file larger than its old free space, and fsck is clean. `cetra status` shows the
# daemon (fence=auto) fenced by persistent reservations.
grow_check() {
    [ -b /dev/ram15 ] && [ -c /dev/fuse ] || { tfail "grow: no brd ram15 or no fuse"; return; }
    table() { i=1; while [ $i -le "$1" ]; do echo "$(( (i - 1) * 8192 )) 8192 linear /dev/ram$i 0"; i=$((i + 1)); done; }
    table 10 | dmsetup --noudevsync create growlun || { tfail "grow: dmsetup create"; return; }
    DM=$(for d in /sys/block/dm-*; do [ "$(cat $d/dm/name)" = growlun ] && basename $d; done)
    D=$T/core/iblock_1/grow; mkdir -p $D || { tfail "grow: mkdir $D"; return; }
    { echo "udev_path=/dev/$DM" > $D/control && echo cetrafs-grow > $D/wwn/vpd_unit_serial &&
        echo 1 > $D/enable; } || { tfail "grow: iblock backstore"; return; }
    export_lun grow; GSG=$LAST_SG; GSD=$LAST_SD
    expect "grow: mkfs $GSD" 0 "can grow to:" mkfs.cetra -f -N 2 --journal-size 4M "$GSD"
    mkdir -p /mnt/g
    expect "grow: mount $GSD" 0 "" mount.cetra "$GSD" /mnt/g -o host=grower
    dd if=/dev/zero of=/mnt/g/before bs=1M count=4 2>/dev/null && sync
    before=$(df -k /mnt/g | awk 'NR==2{print $2}')
    expect "grow: status shows pr fencing" 0 '"fence": "pr"' cetra status --json "$GSD"
    table 15 | dmsetup --noudevsync reload growlun && dmsetup --noudevsync resume growlun ||
        { tfail "grow: dmsetup reload"; return; }
    expect "grow: refused before the sd rescan" 1 "grow the LUN first" cetra grow /mnt/g
    echo 1 > /sys/class/scsi_generic/$(basename $GSG)/device/rescan
    expect "grow: cetra grow after the rescan" 0 "grew from" cetra grow /mnt/g
    after=$(df -k /mnt/g | awk 'NR==2{print $2}')
    if [ "$after" -gt "$before" ]; then tpass "grow: df $before -> $after KiB"; else tfail "grow: df $before -> $after KiB"; fi
    # more than the old volume had free: only the new groups hold it
    big=$(( before / 1024 + 4 ))
    if dd if=/dev/zero of=/mnt/g/big bs=1M count=$big conv=fsync 2>/tmp/dd.err; then
        tpass "grow: wrote $big MiB (the old volume had $((before / 1024)) MiB in all)"
    else
        sed 's|^|OUT grow dd: |' /tmp/dd.err > $R; tfail "grow: writing $big MiB"
    fi
    umount /mnt/g || tfail "grow: umount"
    i=0; while pidof mount.cetra >/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    expect "grow: fsck after the grow" 0 "$GSD: clean" fsck.cetra -n "$GSD"
}
grow_check
say "grow checks done at $(up)s"

# ---- multi-node file system scenarios (lio-check fs-multi, tools/lio-check/src/fsmulti.rs):
# one LUN through three nexuses = three initiators = three nodes, each with its own
# mount.cetra daemon (host=node1..3): visibility, concurrent O_DIRECT writers, SIGKILL of
# node2 and its recovery by a survivor, remount, fsck. Its PASS/FAIL lines count here.
if [ "$MULTINODE" = 1 ] && [ -c /dev/fuse ]; then
    for lun in "d512 $D512SDS" "d4k $D4KSDS"; do
        set -- $lun
        t0=$(up)
        { lio-check fs-multi --tag "$1" --devs "$2" --interval "$MNINTERVAL" \
              --io-timeout "$MNIOTIMEOUT" --files "$MNFILES" --preempt "$PREEMPT" \
              --backing "/srv/$1.img" 2>&1; echo $? > /tmp/fsm.rc; } |
            tee /tmp/fsm-$1.out > $R
        rc=$(cat /tmp/fsm.rc)
        np=$(grep -c '^PASS ' /tmp/fsm-$1.out); nf=$(grep -c '^FAIL ' /tmp/fsm-$1.out)
        TP=$((TP + np)); TF=$((TF + nf))
        [ "$rc" = 0 ] || [ "$nf" -gt 0 ] || tfail "fs-multi $1: lio-check exit $rc without a FAIL line"
        say "fs-multi $1: $np passed, $nf failed, $(awk -v a="$t0" -v b="$(up)" 'BEGIN{printf "%.1f", b-a}')s"
    done
    # fence=pr against fence=none (lio-check fence, tools/lio-check/src/fence.rs): node2 stops
    # between its lease check and a data write, is recovered (and preempted), resumed: with
    # pr its write is refused, with none it lands.
    t0=$(up)
    { lio-check fence --tag d512 --devs "$D512SDS" --interval "$MNINTERVAL" \
          --io-timeout "$MNIOTIMEOUT" --preempt "$PREEMPT" 2>&1; echo $? > /tmp/fence.rc; } |
        tee /tmp/fence.out > $R
    rc=$(cat /tmp/fence.rc)
    np=$(grep -c '^PASS ' /tmp/fence.out); nf=$(grep -c '^FAIL ' /tmp/fence.out)
    TP=$((TP + np)); TF=$((TF + nf))
    [ "$rc" = 0 ] || [ "$nf" -gt 0 ] || tfail "fence: lio-check exit $rc without a FAIL line"
    say "fence d512: $np passed, $nf failed, $(awk -v a="$t0" -v b="$(up)" 'BEGIN{printf "%.1f", b-a}')s"
fi
say "multi-node checks done at $(up)s"

# ---- PREEMPT AND ABORT over iSCSI (lio.iscsi=1). tcm_loop deadlocks in it (README.md), the
# iSCSI fabric submits commands directly. A separate LUN, d512i (fileio, 512-byte blocks, not
# exported through tcm_loop), behind one LIO iSCSI target with three portals on 127.0.0.1 and
# one ACL per initiator; the guest logs in to it three times with iscsistart (open-iscsi's boot
# login tool, no iscsid), once per initiator name iqn...:node1..3 and portal: three sessions =
# three I_T nexuses = three sd/sg nodes of one LUN. On them: the pr check with PREEMPT AND
# ABORT (`pr-iscsi`, ~0.3 s), then lio-check fence with pr_preempt=abort, fence=pr only
# (`fence-pr-iscsi`; the fence=none contrast runs on d512 above). Setup failures are FAIL lines, not a FATAL: the checks above stand.
iscsi_setup() {
    ifconfig lo 127.0.0.1 up || { tfail "iscsi: ifconfig lo"; return 1; }
    [ -d /sys/module/iscsi_target_mod ] && [ -d /sys/class/iscsi_transport/tcp ] ||
        { tfail "iscsi: iscsi_target_mod/iscsi_tcp not loaded"; return 1; }
    backstore d512i block_size=512 emulate_tpu=1
    TIQN=iqn.2003-01.org.linux-iscsi.cetrafs:d512i
    TPG=$T/iscsi/$TIQN/tpgt_1
    { mkdir -p $TPG/lun/lun_0 && ln -s $T/core/fileio_0/d512i $TPG/lun/lun_0/d512i &&
      echo 0 > $TPG/attrib/authentication; } || { tfail "iscsi: target $TIQN"; return 1; }
    for n in 1 2 3; do
        mkdir -p $TPG/np/127.0.0.1:$((3259 + n)) || { tfail "iscsi: portal 127.0.0.1:$((3259 + n))"; return 1; }
    done
    for n in 1 2 3; do
        A=$TPG/acls/iqn.2003-01.org.linux-iscsi.cetrafs:node$n
        { mkdir -p $A/lun_0 && ln -s $TPG/lun/lun_0 $A/lun_0/lun_0; } || { tfail "iscsi: ACL node$n"; return 1; }
    done
    echo 1 > $TPG/enable || { tfail "iscsi: enable $TPG"; return 1; }
    # No NOP-Out pings: without iscsid nobody would recover a connection a slow (TCG) ping
    # timeout dropped.
    for n in 1 2 3; do
        t0=$(up)
        iscsistart -i iqn.2003-01.org.linux-iscsi.cetrafs:node$n -t $TIQN -g 1 -a 127.0.0.1 -p $((3259 + n)) \
            -P 'node.conn[0].timeo.noop_out_interval=0' -P 'node.conn[0].timeo.noop_out_timeout=0' \
            > /tmp/iscsistart-$n.log 2>&1
        rc=$?
        sed "s|^|OUT iscsistart node$n: |" /tmp/iscsistart-$n.log > $R
        [ $rc = 0 ] || { tfail "iscsi: iscsistart node$n exit $rc"; return 1; }
        say "iscsi: node$n logged in ($(awk -v a="$t0" -v b="$(up)" 'BEGIN{printf "%.1f", b-a}')s)"
    done
    # sessionN -> its initiator name and the sd/sg nodes of LUN 0 below it (the LUN scan runs
    # after the login: wait for it)
    ISDS=; ISGS=
    for n in 1 2 3; do
        sd=; sg=; i=0
        while [ $i -lt 200 ]; do
            for s in /sys/class/iscsi_session/session*; do
                [ "$(cat $s/initiatorname 2>/dev/null)" = iqn.2003-01.org.linux-iscsi.cetrafs:node$n ] || continue
                d=$(ls -d $(readlink -f $s/device)/target*/*:*:*:0 2>/dev/null | head -1)
                [ -n "$d" ] || continue
                sd=$(ls $d/block 2>/dev/null | head -1); sg=$(ls $d/scsi_generic 2>/dev/null | head -1)
                sess=$(basename $s)
            done
            [ -n "$sd" ] && [ -n "$sg" ] && [ -b /dev/$sd ] && [ -c /dev/$sg ] && break
            sleep 0.05; i=$((i + 1))
        done
        [ -n "$sd" ] && [ -n "$sg" ] || { tfail "iscsi: no sd/sg node for node$n's session"; return 1; }
        serial=$(sg_vpd -p sn -r /dev/$sg 2>/dev/null | tr -dc 'a-z0-9-')
        say "iscsi: $sess node$n -> /dev/$sg /dev/$sd ($(cat /sys/class/scsi_generic/$sg/device/vendor) $(cat /sys/class/scsi_generic/$sg/device/model) serial $serial)"
        case $serial in *cetrafs-d512i*) ;; *) tfail "iscsi: node$n's /dev/$sg is not d512i (serial '$serial')"; return 1 ;; esac
        ISDS=${ISDS:+$ISDS,}/dev/$sd; ISGS=${ISGS:+$ISGS,}/dev/$sg
    done
    tpass "iscsi: 3 sessions to $TIQN, one LUN (d512i): $ISGS / $ISDS"
}
if [ "$ISCSI" = 1 ]; then
    t0=$(up)
    if iscsi_setup; then
        # pr with PREEMPT AND ABORT (its lines renamed pr-iscsi); a wedged target ends here
        lio-check pr --paths "$ISGS" --pr-abort 1 2>&1 | sed -E 's/^(PASS|FAIL|SKIP|INFO) pr /\1 pr-iscsi /' > /tmp/pri.out
        cat /tmp/pri.out > $R
        np=$(grep -c '^PASS ' /tmp/pri.out); nf=$(grep -c '^FAIL ' /tmp/pri.out)
        TP=$((TP + np)); TF=$((TF + nf))
        [ "$np" -gt 0 ] || [ "$nf" -gt 0 ] || tfail "pr-iscsi: no PASS/FAIL line"
        say "pr-iscsi: $np passed, $nf failed, $(awk -v a="$t0" -v b="$(up)" 'BEGIN{printf "%.1f", b-a}')s since the iSCSI setup began"
        if [ "$nf" = 0 ] && [ "$MULTINODE" = 1 ] && [ -c /dev/fuse ]; then
            t0=$(up)
            { lio-check fence --tag iscsi --devs "$ISDS" --interval "$MNINTERVAL" \
                  --io-timeout "$MNIOTIMEOUT" --preempt abort --modes pr 2>&1; echo $? > /tmp/fence.rc; } |
                tee /tmp/fence-iscsi.out > $R
            rc=$(cat /tmp/fence.rc)
            np=$(grep -c '^PASS ' /tmp/fence-iscsi.out); nf=$(grep -c '^FAIL ' /tmp/fence-iscsi.out)
            TP=$((TP + np)); TF=$((TF + nf))
            [ "$rc" = 0 ] || [ "$nf" -gt 0 ] || tfail "fence iscsi: lio-check exit $rc without a FAIL line"
            say "fence iscsi: $np passed, $nf failed, $(awk -v a="$t0" -v b="$(up)" 'BEGIN{printf "%.1f", b-a}')s"
        fi
    fi
    say "iscsi checks done at $(up)s"
fi
if [ $TF -eq 0 ] && [ $TP -gt 0 ]; then
    echo "CETRA-TOOLS-RESULT PASS ($TP checks)" > $R
else
    echo "CETRA-TOOLS-RESULT FAIL ($TF of $((TP + TF)) checks failed)" > $R
fi
# LIO logs every miscompare ("Detected MISCOMPARE at offset N"): count them, show the rest
say "kernel logged $(dmesg | grep -c "Detected MISCOMPARE") CAW miscompares (printk is rate-limited: a lower bound)"
dmesg | grep -v 'Detected MISCOMPARE' | grep -i -E 'oops|bug|warn|caw|compare|error' | tail -20 | sed 's/^/GUEST dmesg: /' > $R
sync
poweroff -f
sleep 10
