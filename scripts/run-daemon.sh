#!/usr/bin/env bash
# Builds agentvmd in release mode and runs it on its embedded defaults
# (state in /var/lib/agentvm as root, API on unix:/run/agentvm/agentvmd.sock).
# Extra arguments go to agentvmd, e.g. --state-dir DIR --listen unix:PATH.
# Builds the static agentvm-vmm too, for sessions on microVMs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --locked -p agentvmd --bin agentvmd --bin agentvm
# The VMM a node runs is the static build; the microvm runtime starts one per session.
vmm=$(./scripts/build-vmm.sh)
exec ./target/release/agentvmd --vmm-binary "$vmm" "$@"
