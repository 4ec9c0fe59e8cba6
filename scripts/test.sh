#!/usr/bin/env bash
# The whole test suite: formatting, lints, then every test of the workspace.
# CI (.ci/run) runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --locked --workspace --all-targets -- -D warnings
# Benchmarks are built and run once in quick mode so they cannot rot.
echo "== benches (quick mode)"
cargo test --locked --workspace --benches
echo "== tests"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --locked --workspace --no-fail-fast
else
    cargo test --locked --workspace --no-fail-fast
fi
