#!/usr/bin/env bash
# Builds agentvm's guest kernel from Debian's linux-source-6.1 with the checked-in fragment
# images/kernel/agentvm.config (merged over tinyconfig) and prints the vmlinux path.
# Cached by the hash of the fragment and the source package version, so a second run with
# nothing changed is free. A full build takes ~7 minutes on 2 cores.
#
# Note: such a kernel cannot boot on a PVM host (feasibility-pvm.md): it is for hardware
# KVM nodes. Tests that boot it look for AGENTVM_TEST_KERNEL and skip without it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
fragment=$root/images/kernel/agentvm.config
cache=${AGENTVM_KERNEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentvm/kernel}

packages=(linux-source-6.1 build-essential flex bison bc libelf-dev libssl-dev xz-utils dwarves)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >&2
fi
version=$(dpkg-query -W -f='${Version}' linux-source-6.1)
key=$( (cat "$fragment"; echo "linux-source-6.1 $version") | sha256sum | cut -c1-16)
out=$cache/$key
if [ -f "$out/vmlinux" ]; then
    echo "$out/vmlinux"
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building the guest kernel (linux-source-6.1 $version, config $key) in $work" >&2
tar -C "$work" -xf /usr/src/linux-source-6.1.tar.xz
src=$work/linux-source-6.1
cd "$src"
make -s tinyconfig >&2
scripts/kconfig/merge_config.sh -m .config "$fragment" >&2
make -s olddefconfig >&2
# Every option the fragment asks for must have survived olddefconfig's dependency pass.
missing=()
while IFS= read -r line; do
    case "$line" in
        CONFIG_*=y) grep -qx "$line" .config || missing+=("$line") ;;
        "# CONFIG_"*" is not set")
            opt=${line#\# }
            opt=${opt% is not set}
            if grep -q "^$opt=" .config; then missing+=("$opt (should be unset)"); fi ;;
    esac
done <"$fragment"
if [ ${#missing[@]} -gt 0 ]; then
    echo "these options of $fragment did not take (a dependency is missing):" >&2
    printf '  %s\n' "${missing[@]}" >&2
    exit 1
fi
make -s -j"$(nproc)" vmlinux >&2
mkdir -p "$out"
cp .config "$out/config"
cp vmlinux "$out/vmlinux.partial"
mv "$out/vmlinux.partial" "$out/vmlinux"
echo "$out/vmlinux"
