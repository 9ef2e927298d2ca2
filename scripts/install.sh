#!/bin/bash
# Build CetraFS and install the tools where mkfs(8), mount(8) and fsck(8) look for them:
#   /usr/local/sbin/{mkfs,mount,fsck}.cetra, plus links in /sbin (util-linux runs
#   /sbin/mount.cetra for `mount -t cetra` and fstab entries; mkfs/fsck search /sbin too),
#   and the admin tool as /usr/local/sbin/cetra.
# Usage: scripts/install.sh [--uninstall]      (as root)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=${PREFIX:-/usr/local}
TOOLS=(mkfs mount fsck)
export PATH="$HOME/.cargo/bin:$PATH"

[[ $(id -u) -eq 0 ]] || { echo "install.sh: run as root" >&2; exit 1; }

if [[ ${1:-} == --uninstall ]]; then
    for t in "${TOOLS[@]}"; do
        [[ -L /sbin/$t.cetra ]] && rm -f "/sbin/$t.cetra"
        rm -f "$PREFIX/sbin/$t.cetra"
    done
    rm -f "$PREFIX/sbin/cetra" "$PREFIX/share/man/man8/cetra.8"
    echo "install.sh: removed ${TOOLS[*]/%/.cetra} and cetra"
    exit 0
fi

echo "install.sh: cargo build --release --bins"
(cd "$REPO" && cargo build --release --bins)

TARGET=${CARGO_TARGET_DIR:-$REPO/target}
[[ $TARGET == /* ]] || TARGET=$REPO/$TARGET
install -d "$PREFIX/sbin"
for t in "${TOOLS[@]}"; do
    install -m 0755 "$TARGET/release/$t-cetra" "$PREFIX/sbin/$t.cetra"
    # /sbin may be /usr/sbin (merged /usr) or a real directory: a link there works for both.
    if [[ ! -e /sbin/$t.cetra || -L /sbin/$t.cetra ]]; then
        ln -sfn "$PREFIX/sbin/$t.cetra" "/sbin/$t.cetra"
    elif ! cmp -s "/sbin/$t.cetra" "$PREFIX/sbin/$t.cetra"; then
        echo "install.sh: WARNING: /sbin/$t.cetra is a different regular file; left alone" >&2
    fi
    echo "install.sh: $PREFIX/sbin/$t.cetra (+ /sbin/$t.cetra)"
done
install -m 0755 "$TARGET/release/cetra" "$PREFIX/sbin/cetra"
install -D -m 0644 "$REPO/docs/man/cetra.8" "$PREFIX/share/man/man8/cetra.8"
echo "install.sh: $PREFIX/sbin/cetra (man 8 cetra)"
