#!/usr/bin/env bash
# Builds agentvmd in release mode and runs it on its embedded defaults
# (state in /var/lib/agentvm as root, API on unix:/run/agentvm/agentvmd.sock).
# Extra arguments go to agentvmd, e.g. --state-dir DIR --listen unix:PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --locked -p agentvmd --bin agentvmd --bin agentvm
exec ./target/release/agentvmd "$@"
