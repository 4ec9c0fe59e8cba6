#!/usr/bin/env bash
# Installs what building agentvm needs on a fresh Debian 12 machine. Idempotent.
# protoc comes from a registry crate (protoc-bin-vendored) and sqlite is bundled, so the
# system needs only a C toolchain (for sqlite and, later, the test guest), git, and for the
# tests Python and PostgreSQL.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v git >/dev/null 2>&1 || need+=(git)
command -v curl >/dev/null 2>&1 || need+=(curl ca-certificates)
# Tests mint TLS certificates with it.
command -v openssl >/dev/null 2>&1 || need+=(openssl)
# The upstream-compatibility tests run a harness and a client on grpcio (Python).
command -v python3 >/dev/null 2>&1 || need+=(python3)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
# Guest images: a container image's root filesystem is an erofs image (erofs-utils), an
# ext4 workspace template is made with mke2fs (e2fsprogs).
command -v mkfs.erofs >/dev/null 2>&1 || need+=(erofs-utils)
command -v mke2fs >/dev/null 2>&1 || need+=(e2fsprogs)
# Guest networks are plumbed with iproute2's ip (a tap and a veth pair per VM).
[ -x /sbin/ip ] || need+=(iproute2)
# The reflink tests make an XFS filesystem on a loop device.
command -v mkfs.xfs >/dev/null 2>&1 || need+=(xfsprogs)
# The PostgreSQL journal's tests start servers of their own from Debian's packages.
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
if [ ${#need[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi

# grpcio in a venv of the project's own (Debian's Python refuses system-wide pip installs).
venv=target/upstream-venv
if ! "$venv/bin/python" -c 'import grpc, grpc_tools' >/dev/null 2>&1; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check 'grpcio==1.85.*' 'grpcio-tools==1.85.*'
fi

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: cargo not found; install Rust 1.95 with rustup (rust-toolchain.toml pins it)" >&2
    exit 1
fi

# The fleet's tests publish snapshots to a real S3-compatible server: s3s-fs, from the Rust
# registry (into cargo's bin directory).
cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
if ! command -v s3s-fs >/dev/null 2>&1 && [ ! -x "$cargo_bin/s3s-fs" ]; then
    cargo install --quiet --locked s3s-fs --version 0.14.1 --features binary
fi
