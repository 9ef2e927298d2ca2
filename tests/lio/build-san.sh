#!/bin/bash
# Build the cached extra initramfs of the multi-host iSCSI harness (tests/lio/san) into $CACHE
# (default <repo>/.cache/lio, gitignored), on top of what build-guest.sh caches there (Debian's
# 6.1 kernel and base.cpio):
#   san.cpio   the modules a SAN host needs beyond base.cpio (virtio-net, dm-multipath and its
#              path selectors, scsi_dh_alua) and, from Debian 12's own packages (downloaded,
#              not installed on this machine):
#                initiator  open-iscsi's iscsid + iscsiadm, multipath-tools' multipathd +
#                           multipath and their checkers, systemd-udevd + udevadm + scsi_id and
#                           the udev rules of udev, multipath-tools, sg3-utils-udev and dmsetup
#                target     python3.11 (standard library) + python3-rtslib-fb's targetctl, which
#                           restores a targetcli saved configuration (saveconfig.json)
# One cpio serves both roles: tests/lio/san-init.sh picks by the kernel command line.
# Idempotent: does nothing when the stamp (kernel ABI + a hash of this script) matches.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CACHE=${CACHE:-$ROOT/.cache/lio}
WORK=$CACHE/work
T0=$(date +%s.%N)
log() { printf '[build-san %6.1fs] %s\n' "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$*"; }

"$HERE/build-guest.sh"
KVER=$(cat "$CACHE/stamp" | cut -d' ' -f1)
STAMP="$KVER $(sha256sum < "$HERE/build-san.sh" | cut -c1-16)"
if [ -e "$CACHE/san.cpio" ] && [ "$(cat "$CACHE/san.stamp" 2>/dev/null)" = "$STAMP" ]; then
    log "cached: $CACHE/san.cpio ($KVER)"
    exit 0
fi

# ---- 1. packages (downloaded into the cache, extracted into a scratch root)
PKGS="open-iscsi libopeniscsiusr libisns0 multipath-tools liburcu8 libaio1 libedit2 libjson-c5
      libdevmapper1.02.1 dmsetup udev libudev1 libkmod2 libblkid1 libacl1 libcap2 libselinux1 libpcre2-8-0
      sg3-utils-udev python3.11-minimal libpython3.11-minimal libpython3.11-stdlib python3-six
      python3-pyudev python3-rtslib-fb libffi8 libexpat1 zlib1g libgcc-s1"
DEBS=$WORK/san-debs
mkdir -p "$DEBS"
for p in $PKGS; do
    ls "$DEBS"/"${p}"_*.deb >/dev/null 2>&1 && continue
    log "apt-get download $p"
    (cd "$DEBS" && apt-get download "$p" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
    ls "$DEBS"/"${p}"_*.deb >/dev/null 2>&1 || { echo "build-san: could not download $p" >&2; exit 1; }
done
SR=$WORK/san-root
rm -rf "$SR"; mkdir -p "$SR"
for d in "$DEBS"/*.deb; do dpkg-deb -x "$d" "$SR"; done

# ---- 2. kernel modules beyond base.cpio's (the kernel .deb is kept by build-guest.sh)
KROOT=$WORK/kroot-san-$KVER
if [ ! -d "$KROOT/lib/modules/$KVER" ]; then
    log "extract the kernel's modules"
    rm -rf "$KROOT"; mkdir -p "$KROOT"
    dpkg-deb -x "$(ls "$WORK"/linux-image-"$KVER"_*.deb | head -1)" "$KROOT"
    depmod -b "$KROOT" "$KVER"
fi
ST=$WORK/san-stage
rm -rf "$ST"; mkdir -p "$ST"/{bin,sbin,etc,lib64,lib/x86_64-linux-gnu,lib/udev/rules.d,lib/multipath,usr/lib,run}
base_mods=$(cpio -i --to-stdout etc/modules.order < "$CACHE/base.cpio" 2>/dev/null)
: > "$ST/etc/san-modules.order"
for m in virtio_pci virtio_net dm_multipath dm_round_robin dm_service_time scsi_dh_alua; do
    modprobe -d "$KROOT" -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}'
done | awk '!seen[$0]++' | while read -r ko; do
    rel=${ko#"$KROOT"}
    grep -qxF "$rel" <<< "$base_mods" && continue
    mkdir -p "$ST$(dirname "$rel")"
    cp "$ko" "$ST$rel"
    echo "$rel" >> "$ST/etc/san-modules.order"
done

# ---- 3. programs and every library they need, from the scratch root first, then the host's
export LD_LIBRARY_PATH=$SR/lib/x86_64-linux-gnu:$SR/usr/lib/x86_64-linux-gnu:$SR/lib
libs_of() { # FILE...: the shared libraries (full paths) the files need; fails on a missing one
    local f out
    for f in "$@"; do
        out=$(ldd "$f" 2>&1) || continue # not dynamic
        if grep -q 'not found' <<< "$out"; then
            echo "build-san: $f needs libraries neither the packages nor this host have:" >&2
            grep 'not found' <<< "$out" >&2; return 1
        fi
        awk '/=>/{print $3} /ld-linux/{print $1}' <<< "$out"
    done | sort -u
}
# PATH-IN-THE-PACKAGES:DIRECTORY-IN-THE-GUEST
for pair in sbin/iscsid:sbin sbin/iscsiadm:sbin sbin/multipathd:sbin sbin/multipath:sbin \
            sbin/dmsetup:sbin bin/udevadm:sbin lib/udev/scsi_id:lib/udev usr/bin/python3.11:bin; do
    src=$SR/${pair%%:*}
    [ -x "$src" ] || { echo "build-san: $src missing from the packages" >&2; exit 1; }
    cp "$src" "$ST/${pair#*:}/"
done
# systemd-udevd is udevadm under another name (a multi-call binary)
ln -s udevadm "$ST/sbin/systemd-udevd"
ln -s python3.11 "$ST/bin/python3"
cp "$SR"/lib/multipath/*.so "$ST/lib/multipath/"
# the standard library without what a target restore never imports
PYLIB=$SR/usr/lib/python3.11
mkdir -p "$ST/usr/lib/python3.11" "$ST/usr/lib/python3/dist-packages"
(cd "$PYLIB" && tar cf - --exclude=test --exclude=idlelib --exclude=tkinter --exclude=turtledemo \
    --exclude=ensurepip --exclude=lib2to3 --exclude=pydoc_data --exclude='__pycache__' \
    --exclude='config-3.11-*' .) | tar xf - -C "$ST/usr/lib/python3.11"
for m in rtslib_fb six.py pyudev; do cp -a "$SR/usr/lib/python3/dist-packages/$m" "$ST/usr/lib/python3/dist-packages/"; done
cp "$SR/usr/bin/targetctl" "$ST/bin/targetctl"
sed -i '1s|.*|#!/bin/python3|' "$ST/bin/targetctl"
libs_of "$ST"/sbin/* "$ST/bin/python3.11" "$ST"/lib/multipath/*.so "$ST/lib/udev/scsi_id" \
    "$ST"/usr/lib/python3.11/lib-dynload/_ctypes*.so > "$WORK/san-libs" || exit 1
# opened with dlopen, so not visible to ldd: libudev by pyudev (ctypes), libgcc_s by glibc's
# pthread_cancel (multipathd's threads)
{ cat "$WORK/san-libs"; ls "$SR"/{usr/,}lib/x86_64-linux-gnu/{libudev.so.1,libgcc_s.so.1} 2>/dev/null || true; } | sort -u | while read -r lib; do
    case $lib in
        /lib64/*) cp -L "$lib" "$ST/lib64/" ;;
        *) cp -L "$lib" "$ST/lib/x86_64-linux-gnu/" ;;
    esac
done
for l in libudev.so.1 libgcc_s.so.1; do
    [ -e "$ST/lib/x86_64-linux-gnu/$l" ] || { echo "build-san: $l missing from the packages" >&2; exit 1; }
done

# ---- 4. udev rules: what names SCSI disks (ID_SERIAL, by-id), multipath's and device-mapper's
for r in 50-udev-default 55-scsi-sg3_id 58-scsi-sg3_symlink 60-persistent-storage 60-block \
         11-dm-mpath 56-dm-mpath 60-multipath 62-multipath 68-del-part-nodes \
         55-dm 95-dm-notify 60-persistent-storage-dm; do
    f=$(ls "$SR"/lib/udev/rules.d/$r.rules "$SR"/usr/lib/udev/rules.d/$r.rules 2>/dev/null | head -1 || true)
    [ -n "$f" ] && cp "$f" "$ST/lib/udev/rules.d/"
done
ls "$ST/lib/udev/rules.d" | tr '\n' ' ' > "$WORK/san-rules"

(cd "$ST" && find . -print0 | cpio --null -o -H newc --quiet) > "$CACHE/san.cpio.tmp"
mv "$CACHE/san.cpio.tmp" "$CACHE/san.cpio"
echo "$STAMP" > "$CACHE/san.stamp"
rm -rf "$SR" "$ST"
log "done: $(du -sh "$CACHE/san.cpio" | cut -f1) san.cpio (rules: $(cat "$WORK/san-rules"))"
