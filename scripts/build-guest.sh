#!/usr/bin/env bash
# Builds what goes inside a guest image as static binaries: agentvm-guest (the agent, /init)
# and agentvm-harness (the reference harnesses). Prints the directory holding both.
set -euo pipefail
cd "$(dirname "$0")/.."
target=x86_64-unknown-linux-gnu
# With an explicit --target, RUSTFLAGS reach only the target's crates (not build scripts).
# Stripped: every byte is copied into each image's initramfs and into guest RAM.
RUSTFLAGS="-C target-feature=+crt-static" \
    CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols \
    cargo build --release --locked --target "$target" \
    -p agentvm-guest --bin agentvm-guest -p agentvm-harnesses --bin agentvm-harness >&2
echo "$PWD/target/$target/release"
