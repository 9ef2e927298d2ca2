#!/bin/sh
# /init of the LIO test guest (busybox sh). Sets up LIO purely through configfs, exports the
# backstores through tcm_loop as local SCSI disks, runs /bin/lio-check and powers off.
# Results go to the second serial port (/dev/ttyS1 -> host file results.log), kernel noise
# stays on ttyS0 (console.log).
# Kernel command line knobs: lio.size=64M  lio.cawtotal=10200  lio.paths=3  lio.stall=0
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
for a in $(cat /proc/cmdline); do
    case $a in
        lio.size=*) SIZE=${a#*=} ;;
        lio.cawtotal=*) CAWTOTAL=${a#*=} ;;
        lio.paths=*) NPATHS=${a#*=} ;;
        lio.stall=*) STALLTEST=${a#*=} ;;
    esac
done
case $SIZE in
    *[mM]) BYTES=$(( ${SIZE%?} * 1024 * 1024 )) ;;
    *[gG]) BYTES=$(( ${SIZE%?} * 1024 * 1024 * 1024 )) ;;
    *) BYTES=$SIZE ;;
esac
say "booted in $(cut -d' ' -f1 /proc/uptime)s, $(nproc) vCPU(s)"

# LIO's db_root must exist before target_core_mod loads (PR/ALUA metadata live there).
mkdir -p /etc/target/pr /etc/target/alua
while read -r ko; do insmod "$ko" 2>/dev/null || echo "insmod $ko failed (ignored)"; done < /etc/modules.order
mount -t configfs configfs /sys/kernel/config || die "configfs"
T=/sys/kernel/config/target
[ -d $T/core ] || die "target_core_mod not loaded"
mkdir -p /srv && mount -t tmpfs -o size=$((BYTES * 4)),mode=0700 srv /srv

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
export_lun d512; D512=$LAST_SG; D512SD=$LAST_SD; PATHS=$LAST_SG
p=1; while [ $p -lt "$NPATHS" ]; do export_lun d512; PATHS="$PATHS,$LAST_SG"; p=$((p + 1)); done
export_lun d4k; D4K=$LAST_SG; D4KSD=$LAST_SD
export_lun nocaw; NOCAW=$LAST_SG
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

/bin/lio-check all --d512 $D512 --d512-sd $D512SD --d4k $D4K --d4k-sd $D4KSD \
    --paths "$PATHS" --nocaw $NOCAW --size $BYTES --caw-total $CAWTOTAL $STALL > $R 2>&1
rc=$?
say "lio-check exit $rc at $(cut -d' ' -f1 /proc/uptime)s"
# LIO logs every miscompare ("Detected MISCOMPARE at offset N"): count them, show the rest
say "kernel logged $(dmesg | grep -c "Detected MISCOMPARE") CAW miscompares (printk is rate-limited: a lower bound)"
dmesg | grep -v 'Detected MISCOMPARE' | grep -i -E 'oops|bug|warn|caw|compare|error' | tail -20 | sed 's/^/GUEST dmesg: /' > $R
sync
poweroff -f
sleep 10
