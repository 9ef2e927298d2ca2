#!/bin/bash
# Install what CetraFS needs to build, mount, test and benchmark on Debian/Ubuntu.
# Idempotent: packages already present are skipped; safe to run on every CI run.
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
    echo "deps.sh: run as root (apt-get is needed)" >&2
    exit 1
fi

PKGS=(fuse3 fio attr acl e2fsprogs util-linux build-essential pkg-config curl ca-certificates)
missing=()
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
if ((${#missing[@]})); then
    echo "deps.sh: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
    echo "deps.sh: apt packages present"
fi

# FUSE needs the device node; in containers it may need the module loaded.
if [[ ! -e /dev/fuse ]]; then
    modprobe fuse 2>/dev/null || true
fi
[[ -e /dev/fuse ]] || echo "deps.sh: WARNING: /dev/fuse is missing; mounts will not work" >&2

# Rust: use the toolchain already on PATH (or in ~/.cargo); install rustup only if there is none.
if ! command -v cargo >/dev/null 2>&1; then
    if [[ -x "$HOME/.cargo/bin/cargo" ]]; then
        echo "deps.sh: cargo found in ~/.cargo/bin (add it to PATH)"
    else
        echo "deps.sh: installing the Rust toolchain with rustup"
        curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain stable
    fi
else
    echo "deps.sh: $(cargo --version)"
fi

# scripts/test gates on `cargo fmt --check` and `cargo clippy -D warnings`: a minimal rustup
# profile ships neither, so add whichever component the active toolchain lacks.
export PATH="$HOME/.cargo/bin:$PATH"
if command -v rustup >/dev/null 2>&1; then
    installed=$(rustup component list --installed 2>/dev/null)
    for c in clippy rustfmt; do
        if ! grep -q "^$c" <<<"$installed"; then
            echo "deps.sh: adding rustup component $c"
            rustup component add "$c"
        fi
    done
fi
for tool in "cargo clippy" "cargo fmt"; do
    $tool --version >/dev/null 2>&1 || echo "deps.sh: WARNING: '$tool' is missing; the lint steps will fail" >&2
done

# The test runner (scripts/test): cargo-nextest, prebuilt on the usual Rust machines; built
# from crates.io otherwise (a few minutes, once).
if ! cargo nextest --version >/dev/null 2>&1; then
    echo "deps.sh: installing cargo-nextest"
    cargo install --locked cargo-nextest
fi
