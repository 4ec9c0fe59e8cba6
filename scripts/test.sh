#!/usr/bin/env bash
# The whole test suite: formatting, lints, every test of the workspace, then the Linux lane
# (real Linux guests inside an emulated-SVM L1; tests/linux/run.sh). CI (.ci/run) runs
# exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A CI run builds once from a clean clone: incremental state would only cost disk (6.5 GB).
if [ "${CI:-}" = true ]; then
    export CARGO_INCREMENTAL=0
fi
echo "== disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free where the build goes"

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --locked --workspace --all-targets -- -D warnings
# What VMMs leave on the host (their cgroups, their RAM directories), counted before the
# tests so a node's own sessions are not blamed on them.
vm_leftovers() {
    {
        find /sys/fs/cgroup -path '*/agentvm-vms/*' -type d 2>/dev/null || true
        find /dev/shm "${TMPDIR:-/tmp}" -maxdepth 1 -name 'agentvm-sess-*' 2>/dev/null || true
    } | sort
}
before_tests=$(vm_leftovers)
# Benchmarks are built and run once in quick mode so they cannot rot.
echo "== benches (quick mode)"
cargo test --locked --workspace --benches
echo "== tests"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --locked --workspace --no-fail-fast
else
    cargo test --locked --workspace --no-fail-fast
fi
echo "== the Linux lane"
bash tests/linux/run.sh
echo "== leftover VMMs"
# VMMs outlive a daemon by design; every test must reap the ones it started.
leftover=$(ps -eo pid=,args= | awk '$2 ~ /agentvm-vmm$/' || true)
if [ -n "$leftover" ]; then
    echo "these agentvm-vmm processes outlived the tests:"
    echo "$leftover"
    exit 1
fi
echo "== leftover test servers"
left=$(ps -eo pid=,comm=,args= | awk '($2 == "postgres" && /agentvm-pg-/) || $2 == "s3s-fs"' || true)
if [ -n "$left" ]; then
    echo "these PostgreSQL or S3 servers outlived the tests:"
    echo "$left"
    exit 1
fi
echo "== leftover guest networks"
# A networked VM's host veth (avnN) goes with its VMM's namespace.
left=$(ls /sys/class/net | grep '^avn' || true)
if [ -n "$left" ]; then
    echo "these guest network interfaces outlived the tests:"
    echo "$left"
    exit 1
fi
echo "== leftover VMM cgroups and RAM directories"
left=$(comm -13 <(echo "$before_tests") <(vm_leftovers))
if [ -n "$left" ]; then
    echo "the tests left these behind:"
    echo "$left"
    exit 1
fi
