#!/bin/bash
# Build the cached guest artefacts for the LIO harness into $CACHE (default
# <repo>/.cache/lio, gitignored):
#   vmlinux / vmlinuz   Debian's own 6.1 kernel, taken from the linux-image .deb (not installed)
#   base.cpio           busybox-static + target_core/tcm_loop/sd/sg/fuse modules + a few sg3-utils
#                       + LIO's iSCSI target and the open-iscsi initiator (iscsi_tcp + iscsistart)
# The per-run part of the initramfs (/init, lio-check and the static mkfs/fsck/mount binaries) is a second cpio that
# `run` concatenates after base.cpio; the kernel unpacks concatenated newc archives in order.
# Idempotent: does nothing when the cache stamp (kernel ABI from linux-image-amd64's
# dependency + a hash of this script) matches.
# Adapted from the verified recipe in the project notes (shared lio-vm, 2026-11-29).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CACHE=${CACHE:-$ROOT/.cache/lio}
WORK=$CACHE/work
T0=$(date +%s.%N)
log() { printf '[build %6.1fs] %s\n' "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$*"; }

# ---- 1. host packages. sg3-utils: a few binaries copied into the guest for debugging;
#         dmsetup: the guest suspends a dm device under one LUN to stall its I/O.
apt-cache show linux-image-amd64 >/dev/null 2>&1 || { log "apt-get update"; apt-get update >/dev/null; }
need=()
for p in qemu-system-x86 busybox-static sg3-utils dmsetup cpio xz-utils kmod; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    log "apt-get install ${need[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null
fi

# KMETA: the kernel meta-package (default Debian 12's 6.1; e.g. linux-image-6.12-amd64 with
# CACHE=<repo>/.cache/lio-6.12 keeps a second guest kernel beside the default one)
KMETA=${KMETA:-linux-image-amd64}
KPKG=$(apt-cache depends "$KMETA" | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
[ -n "$KPKG" ] || { echo "cannot resolve the kernel package behind $KMETA" >&2; exit 1; }
KVER=${KPKG#linux-image-}
# cache key: kernel ABI + this script's content (mtimes change with every checkout)
STAMP="$KVER $(sha256sum < "$HERE/build-guest.sh" | cut -c1-16)"
if [ -e "$CACHE/base.cpio" ] && [ -e "$CACHE/vmlinuz" ] && [ "$(cat "$CACHE/stamp" 2>/dev/null)" = "$STAMP" ]; then
    log "cached: $CACHE ($KVER)"
    exit 0
fi

# ---- 2. kernel .deb (downloaded, NOT installed on the host)
mkdir -p "$WORK" "$CACHE"
DEB=$(ls "$WORK"/"${KPKG}"_*.deb 2>/dev/null | head -1 || true)
if [ -z "$DEB" ]; then
    log "apt-get download $KPKG"
    (cd "$WORK" && apt-get download "$KPKG" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
    DEB=$(ls "$WORK"/"${KPKG}"_*.deb | head -1)
fi
KROOT=$WORK/kroot-$KVER
if [ ! -e "$KROOT/boot/vmlinuz-$KVER" ]; then
    log "extract $(basename "$DEB")"
    rm -rf "$KROOT"; mkdir -p "$KROOT"
    dpkg-deb -x "$DEB" "$KROOT"
    depmod -b "$KROOT" "$KVER"
fi
cp "$KROOT/boot/vmlinuz-$KVER" "$CACHE/vmlinuz"
# Uncompressed ELF vmlinux (the scripts/extract-vmlinux method): qemu boots it through the
# PVH entry note and skips the in-guest xz decompression, which halves the boot under TCG.
off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$CACHE/vmlinuz" | head -1 | cut -d: -f1 || true)
rm -f "$CACHE/vmlinux"
tail -c +$((off + 1)) "$CACHE/vmlinuz" | xz -dc > "$CACHE/vmlinux" 2>/dev/null || true
[ "$(head -c 4 "$CACHE/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ] ||
    { log "vmlinux extraction failed; will boot the bzImage"; rm -f "$CACHE/vmlinux"; }

# ---- 3. base initramfs
ST=$WORK/initrd
rm -rf "$ST"; mkdir -p "$ST"/{bin,sbin,dev,proc,sys,tmp,srv,etc,lib64,lib/x86_64-linux-gnu,lib/modules/$KVER}
cp /bin/busybox "$ST/bin/busybox"
# `busybox --list` contains busybox itself: linking it would replace the binary by a self-link
for a in $(/bin/busybox --list); do [ "$a" = busybox ] || ln -s busybox "$ST/bin/$a"; done
ln -sf ../bin/busybox "$ST/sbin/modprobe"
# brd + dm_mod: a RAM disk behind dm-linear behind an iblock backstore, for the stall test;
# fuse: mount.cetra on a tcm_loop disk
# iscsi_target_mod + iscsi_tcp (libiscsi_tcp, libiscsi, scsi_transport_iscsi): the guest logs in
# to its own LIO iSCSI target (lio.iscsi=1), a fabric that submits directly (unlike tcm_loop)
MODS="crc32c_generic crc32c_intel configfs target_core_mod target_core_file target_core_iblock tcm_loop sd_mod sg brd dm_mod fuse"
MODS="$MODS iscsi_target_mod iscsi_tcp"
: > "$ST/etc/modules.order"
for m in $MODS; do
    modprobe -d "$KROOT" -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}'
done | awk '!seen[$0]++' | while read -r ko; do
    rel=${ko#"$KROOT"}
    mkdir -p "$ST$(dirname "$rel")"
    cp "$ko" "$ST$rel"
    echo "$rel" >> "$ST/etc/modules.order"
done
cp "$KROOT/lib/modules/$KVER/modules.builtin"* "$KROOT/lib/modules/$KVER/modules.order" "$ST/lib/modules/$KVER/"
depmod -b "$ST" "$KVER"
# iscsistart (open-iscsi's boot-time login tool: logs in without iscsid) and the library it
# needs beyond the host's (libopeniscsiusr), from their .debs: downloaded, not installed
OI=$WORK/open-iscsi
if [ ! -x "$OI/sbin/iscsistart" ]; then
    rm -rf "$OI"; mkdir -p "$OI"
    for p in open-iscsi libopeniscsiusr; do
        ls "$WORK"/${p}_*.deb >/dev/null 2>&1 || { log "apt-get download $p"
            (cd "$WORK" && apt-get download "$p" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true); }
        dpkg-deb -x "$(ls "$WORK"/${p}_*.deb | head -1)" "$OI"
    done
fi
export LD_LIBRARY_PATH=$OI/usr/lib/x86_64-linux-gnu
if ldd "$OI/sbin/iscsistart" | grep 'not found'; then
    echo "iscsistart needs libraries the host lacks (see above)" >&2; exit 1
fi
# sg3-utils (debugging), dmsetup and iscsistart, dynamically linked: host and guest are both
# Debian 12
for b in /usr/bin/sg_inq /usr/bin/sg_readcap /usr/bin/sg_vpd /usr/bin/sg_dd /usr/bin/sg_turs \
         /usr/bin/sg_raw /usr/bin/sg_compare_and_write /usr/sbin/dmsetup "$OI/sbin/iscsistart"; do
    cp "$b" "$ST/bin/"
    ldd "$b" | awk '/=>/{print $3} /ld-linux/{print $1}'
done | sort -u | while read -r lib; do
    [ -e "$lib" ] || continue
    case $lib in
        /lib64/*) cp -L "$lib" "$ST/lib64/" ;;
        *) cp -L "$lib" "$ST/lib/x86_64-linux-gnu/" ;;
    esac
done
echo "$KVER" > "$ST/etc/kver"
(cd "$ST" && find . -print0 | cpio --null -o -H newc --quiet) > "$CACHE/base.cpio.tmp"
mv "$CACHE/base.cpio.tmp" "$CACHE/base.cpio"
echo "$STAMP" > "$CACHE/stamp"
# the unpacked package tree (~400 MB) is only needed while building; keep the .deb (70 MB)
rm -rf "$KROOT" "$ST" "$OI"
log "done: $(du -sh "$CACHE/base.cpio" | cut -f1) base.cpio, kernel $KVER"
