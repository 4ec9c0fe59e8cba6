#!/usr/bin/env bash
# The reported fuzz run, apart from CI: fresh random seeds of the request fuzz test
# (daemon/tests/request_fuzz.rs), each on a node of its own. CI replays only the fixed seeds
# in daemon/tests/request_fuzz_seeds.txt, so a seed drawn by chance never fails a change that
# did not cause it; this run is where new seeds are found. A seed that fails is printed with
# the command that replays it: fix the bug, then add the seed to that file.
#
#   scripts/fuzz.sh [RUNS]     (default 20; AGENTVM_FUZZ_CASES sets each run's length)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20}
cargo build --locked -p agentvmd --tests --quiet
passed=0 failed=0 failing=()
for _ in $(seq "$runs"); do
    seed=$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')
    if AGENTVM_FUZZ_SEED=$seed cargo test --locked -p agentvmd --test request_fuzz --quiet \
        >"target/fuzz-$seed.log" 2>&1; then
        passed=$((passed + 1))
        rm -f "target/fuzz-$seed.log"
    else
        failed=$((failed + 1))
        failing+=("$seed")
        echo "fuzz: seed $seed failed (log: target/fuzz-$seed.log)"
        echo "  replay: AGENTVM_FUZZ_SEED=$seed cargo test -p agentvmd --test request_fuzz"
    fi
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
