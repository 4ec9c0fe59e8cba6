#!/usr/bin/env bash
# Builds the reference guest image NAME (echo, counter or chat; images/NAME/image.toml) into
# target/images/linux-NAME: a node serves a bundle under its directory name, and the bare
# names belong to the built-in harnesses. Static agent and harness, the cached kernel
# (scripts/build-kernel.sh, or $AGENTVM_KERNEL when set), then `agentvm image build`.
# Prints the bundle directory.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: scripts/build-image.sh echo|counter|chat}
[ -f "images/$name/image.toml" ] || { echo "no images/$name/image.toml" >&2; exit 2; }
bin=$(scripts/build-guest.sh)
kernel=${AGENTVM_KERNEL:-$(scripts/build-kernel.sh)}
cargo build --release --locked -p agentvmd --bin agentvm >&2
out=target/images/linux-$name
target/release/agentvm image build --config "images/$name/image.toml" -o "$out" \
    --kernel "$kernel" --agent "$bin/agentvm-guest" >&2
echo "$PWD/$out"
