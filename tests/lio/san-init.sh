#!/bin/sh
# /init of the multi-host iSCSI harness's guests (tests/lio/san; busybox sh). One kernel per
# host: the kernel command line says which host this is.
#   san.role=target   the SAN: LIO restored from a targetcli saved configuration
#                     (/etc/target/saveconfig.json, made by tests/lio/san) with `targetctl
#                     restore`: fileio LUNs d512 and d4k (emulate_caw=1, emulate_pr=1) behind
#                     one iSCSI target with two portals, 10.0.2.15:3260 on eth0 and 10.0.3.15:3260
#                     on eth1 (two qemu user networks: two fabrics). Prints SAN-TARGET-READY.
#   san.role=node san.node=N
#                     a Proxmox-like host nodeN: iscsid with the fail-fast settings of docs/san.md,
#                     udevd, and (after the login the harness asks for) multipathd; its eth0
#                     reaches both portals through the host (10.0.2.2:PORT1 and :PORT2).
# Both then serve the harness on the second serial port (/dev/ttyS1): a line "ID COMMAND" runs
# COMMAND with sh; its output comes back as "ID| line" lines and then "@@DONE ID RC". Kernel
# and daemon noise stays on ttyS0 (console-*.log on the host).
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mkdir -p /run && mount -t tmpfs tmpfs /run
exec </dev/console >/dev/console 2>&1
C=/dev/ttyS1
say() { echo "san-guest: $*"; echo "GUEST $*" > $C; }
die() { say "FATAL: $*"; dmesg | tail -30 > $C; echo "SAN-GUEST-FAILED $*" > $C; sync; poweroff -f; sleep 5; }

ROLE=; NODE=0
for a in $(cat /proc/cmdline); do
    case $a in
        san.role=*) ROLE=${a#*=} ;;
        san.node=*) NODE=${a#*=} ;;
    esac
done
stty -F $C raw -echo 2>/dev/null
# iscsid refuses requests from a user it cannot name
echo 'root:x:0:0:root:/root:/bin/sh' > /etc/passwd; echo 'root:x:0:' > /etc/group
# LIO's db_root (PR and ALUA metadata): Debian's rtslib-fb sets it to /etc/rtslib-fb-target
mkdir -p /etc/target/pr /etc/target/alua /etc/rtslib-fb-target/pr /etc/rtslib-fb-target/alua
while read -r ko; do insmod "$ko" 2>/dev/null; done < /etc/modules.order
while read -r ko; do insmod "$ko" 2>/dev/null || say "insmod $ko failed"; done < /etc/san-modules.order
mount -t configfs configfs /sys/kernel/config 2>/dev/null
ifconfig lo 127.0.0.1 up

case $ROLE in
target)
    hostname san-target
    ifconfig eth0 10.0.2.15 netmask 255.255.255.0 up || die "eth0"
    ifconfig eth1 10.0.3.15 netmask 255.255.255.0 up || die "eth1"
    mkdir -p /srv && mount -t tmpfs -o mode=0700 srv /srv
    [ -e /etc/target/saveconfig.json ] || die "no saved configuration"
    PYTHONDONTWRITEBYTECODE=1 targetctl restore /etc/target/saveconfig.json > /tmp/restore.log 2>&1 ||
        { sed 's/^/OUT restore: /' /tmp/restore.log > $C; die "targetctl restore"; }
    say "target restored at $(cut -d' ' -f1 /proc/uptime)s: $(ls /sys/kernel/config/target/iscsi | grep iqn) portals $(ls /sys/kernel/config/target/iscsi/iqn*/tpgt_1/np | tr '\n' ' ')"
    echo "SAN-TARGET-READY" > $C
    ;;
node)
    hostname node$NODE
    ifconfig eth0 10.0.2.15 netmask 255.255.255.0 up || die "eth0"
    route add default gw 10.0.2.2
    mkdir -p /etc/iscsi/nodes /etc/iscsi/send_targets /etc/iscsi/ifaces /run/lock /etc/multipath
    echo "InitiatorName=iqn.2003-01.org.linux-iscsi.cetrafs:node$NODE" > /etc/iscsi/initiatorname.iscsi
    # udevd names the SCSI disks (ID_SERIAL: multipath's WWID) and completes device-mapper's
    # udev handshake; iscsid keeps the sessions (and restores them after a path comes back)
    systemd-udevd --daemon --resolve-names=never 2>/dev/null || die "udevd"
    udevadm trigger --action=add >/dev/null 2>&1; udevadm settle -t 30
    iscsid || die "iscsid"
    say "node$NODE up at $(cut -d' ' -f1 /proc/uptime)s"
    echo "SAN-NODE-READY $NODE" > $C
    ;;
*) die "san.role= missing" ;;
esac

# the command server (one descriptor kept open: a serial port's input may be flushed when its
# last descriptor closes)
exec 3<>$C
while IFS= read -r line <&3; do
    id=${line%% *}; cmd=${line#* }
    [ -n "$id" ] || continue
    sh -c "$cmd" > /tmp/cmd.out 2>&1 < /dev/null 3>&-
    rc=$?
    # an output without a final newline would run into the @@DONE line
    [ -n "$(tail -c 1 /tmp/cmd.out)" ] && echo >> /tmp/cmd.out
    sed "s/^/$id| /" /tmp/cmd.out >&3
    echo "@@DONE $id $rc" >&3
done
die "command channel closed"
