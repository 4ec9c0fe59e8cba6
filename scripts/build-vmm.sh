#!/usr/bin/env bash
# Builds agentvm-vmm as a static binary (static-pie, glibc linked in): nothing to find at
# run time, so it runs unchanged inside a VM's private mount namespace, and its resident
# memory per VM is ~1.3 MiB lower than a dynamically linked build (no shared libc mapping).
# The `vmm` profile (whole-program, optimised for size) keeps its resident code small:
# that is paid per VM too.
# Prints the path of the binary.
set -euo pipefail
cd "$(dirname "$0")/.."
target=x86_64-unknown-linux-gnu
# With an explicit --target, RUSTFLAGS reach only the target's crates, not build scripts or
# proc macros (which cannot be static).
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --profile vmm --locked -p agentvm-vmm --bin agentvm-vmm --target "$target" >&2
echo "$PWD/target/$target/vmm/agentvm-vmm"
