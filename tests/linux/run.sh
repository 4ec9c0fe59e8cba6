#!/usr/bin/env bash
# The Linux lane: real Linux guests through agentvmd, on a machine whose own /dev/kvm cannot
# boot them (PVM). Debian's QEMU in pure emulation gives an L1 Linux an AMD SVM CPU with
# nested paging; KVM inside L1 runs our VMM and real Linux guests (L2). This script installs
# what it needs (Debian packages only), builds the static binaries, the guest kernel (cached)
# and the images, packs an L1 initramfs, boots it once per CPU model with a console watchdog,
# and reports every scenario. Timings in here are emulated: correctness only.
#
#   tests/linux/run.sh [SCENARIO…]     (default: every scenario; names: agentvm-lane --help)
#
# Writes target/linux-lane/: results.json ({"scenarios": [{name, passed, seconds, detail}]}),
# per L1 run the L1 console log, agentvmd's log and every guest's serial log. Exits non-zero
# if any scenario failed; the last line is `lane: N passed, N failed`.
#
# Environment: AGENTVM_LANE_CACHE (default ~/.cache/agentvm/lane) keeps the L1 kernel;
# AGENTVM_LANE_RUNS (default "phys48 phys40") picks the L1 boots; CLOUD_HYPERVISOR, the path
# of a stock Cloud Hypervisor (v52 or later, statically linked: the L1 has no libraries),
# adds a boot that runs the session scenarios once more on it (agentvmd's
# --vmm-flavour cloud-hypervisor, jailed as every VMM is).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
lane=$root/tests/linux
out=$root/target/linux-lane
cache=${AGENTVM_LANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentvm/lane}
target=x86_64-unknown-linux-gnu
bin=$root/target/$target/release
log() { echo "lane: $*" >&2; }

# ---- packages
# erofs-utils and e2fsprogs: the images with a container root or an ext4 workspace.
# kmod: depmod, which writes the L1 kernel's modules.dep (a fresh machine may lack it).
packages=(qemu-system-x86 busybox-static cpio erofs-utils e2fsprogs iproute2 kmod)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    log "installing ${packages[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
fi

# ---- L1 kernel: Debian's current 6.1 image, unpacked (not installed) and cached
l1_kernel() {
    local name dir deb
    name=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-6/{print $2; exit}')
    if [ -z "$name" ]; then
        apt-get update -qq
        name=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-6/{print $2; exit}')
    fi
    [ -n "$name" ] || { log "no linux-image-6.* package in apt's lists"; return 1; }
    dir=$cache/$name
    # A cache entry is complete only with its modules.dep (an earlier run without depmod
    # left entries that had none).
    if [ ! -f "$dir/done" ] || ! ls "$dir"/x/lib/modules/*/modules.dep >/dev/null 2>&1; then
        log "fetching $name-unsigned for the L1"
        rm -rf "$dir" && mkdir -p "$dir/deb"
        (cd "$dir/deb" && apt-get download "$name-unsigned" >/dev/null 2>&1) ||
            { log "apt-get download $name-unsigned failed"; return 1; }
        deb=$(ls "$dir"/deb/*.deb)
        dpkg-deb -x "$deb" "$dir/x" || { log "unpacking $deb failed"; return 1; }
        rm -f "$deb"
        # The package leaves modules.dep to its install scripts. (This runs inside a command
        # substitution, where `set -e` does not stop the script: every step says so itself.)
        depmod -b "$dir/x" "$(basename "$(ls -d "$dir"/x/lib/modules/*)")" ||
            { log "depmod failed for $name"; return 1; }
        touch "$dir/done"
    fi
    echo "$dir/x"
}
l1=$(l1_kernel) || { log "no L1 kernel"; exit 1; }
l1_vmlinuz=$(ls "$l1"/boot/vmlinuz-*)
l1_modules=$(ls -d "$l1"/lib/modules/*)

# ---- binaries (static, stripped: they are copied into the L1 and the guest images)
log "building the static binaries"
RUSTFLAGS="-C target-feature=+crt-static" \
    CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols \
    cargo build --release --locked --target "$target" \
    -p agentvmd --bin agentvmd --bin agentvm \
    -p agentvm-vmm --bin agentvm-vmm \
    -p agentvm-guest --bin agentvm-guest \
    -p agentvm-harnesses --bin agentvm-harness \
    -p agentvm-linux-lane --bin agentvm-lane --bin agentvm-lane-probe --bin agentvm-lane-oci >&2

# ---- guest kernel and images
kernel=${AGENTVM_KERNEL:-$(scripts/build-kernel.sh)}
stage=$(mktemp -d)
trap 'rm -rf "$stage"; rm -f "$root/images/echo/.cold.toml" "$lane/oci/.cold.toml"' EXIT
mkdir -p "$stage/lane/bin" "$stage/lane/images" "$stage/bin" "$stage/lib/modules"
for name in echo counter chat probe; do
    config=images/$name/image.toml
    [ "$name" = probe ] && config=$lane/probe/image.toml
    "$bin/agentvm" image build --config "$config" -o "$stage/lane/images/linux-$name" \
        --kernel "$kernel" --agent "$bin/agentvm-guest" >&2
done
"$bin/agentvm" image build --config "$lane/probe/network.toml" -o "$stage/lane/images/linux-probe-net" \
    --kernel "$kernel" --agent "$bin/agentvm-guest" >&2
# `cold_boot = true` twins, which boot every session: what a template is measured against.
# Written beside the original, whose [build] paths are relative to it.
with_cold_boot() { sed 's/^\[vm\]$/[vm]\ncold_boot = true/' "$1" > "$2"; }
with_cold_boot images/echo/image.toml images/echo/.cold.toml
"$bin/agentvm" image build --config images/echo/.cold.toml -o "$stage/lane/images/linux-echo-cold" \
    --kernel "$kernel" --agent "$bin/agentvm-guest" >&2
rm -f images/echo/.cold.toml
# The container image: an OCI layout written here (no registry is reachable), booted as an
# erofs root filesystem.
"$bin/agentvm-lane-oci" --out "$stage/oci-layout" --harness "$bin/agentvm-harness"
"$bin/agentvm" image build --config "$lane/oci/image.toml" --oci "$stage/oci-layout" \
    -o "$stage/lane/images/linux-oci-echo" --kernel "$kernel" --agent "$bin/agentvm-guest" >&2
rm -rf "$stage/oci-layout"
# The Python reference harness (Debian's python3 and the venv's grpcio, packed as an image).
[ -x "$root/target/upstream-venv/bin/python" ] || bash "$root/scripts/setup.sh" >&2
python3 "$root/images/python/make-oci.py" --venv "$root/target/upstream-venv" \
    --out "$stage/python-layout" >&2
"$bin/agentvm" image build --config "$lane/oci/python.toml" \
    --oci "$stage/python-layout" -o "$stage/lane/images/linux-python" \
    --kernel "$kernel" --agent "$bin/agentvm-guest" >&2
with_cold_boot "$lane/oci/python.toml" "$lane/oci/.cold.toml"
"$bin/agentvm" image build --config "$lane/oci/.cold.toml" \
    --oci "$stage/python-layout" -o "$stage/lane/images/linux-python-cold" \
    --kernel "$kernel" --agent "$bin/agentvm-guest" >&2
rm -f "$lane/oci/.cold.toml"
rm -rf "$stage/python-layout"
cp "$bin"/{agentvmd,agentvm,agentvm-vmm,agentvm-lane} "$stage/lane/bin/"
if [ -n "${CLOUD_HYPERVISOR:-}" ]; then
    [ -x "$CLOUD_HYPERVISOR" ] || { log "CLOUD_HYPERVISOR=$CLOUD_HYPERVISOR is not an executable"; exit 2; }
    cp "$CLOUD_HYPERVISOR" "$stage/lane/bin/cloud-hypervisor"
fi

# ---- L1 root: busybox, the KVM and 9p modules in dependency order, our binaries and images
cp /bin/busybox "$stage/bin/busybox"
# agentvmd plumbs guest networks with iproute2's ip (busybox's has no -batch or tuntap):
# the binary and the shared libraries it loads.
mkdir -p "$stage/sbin"
cp /usr/sbin/ip "$stage/sbin/ip"
for library in $(ldd /usr/sbin/ip | grep -o '/[^ ]*'); do
    mkdir -p "$stage$(dirname "$library")"
    cp -L "$library" "$stage$library"
done
cp "$lane/l1-init.sh" "$stage/init"
# modules.dep lists each module's dependencies; load them depth-first, each once.
declare -A loaded=()
order=()
add_module() {
    local rel=$1 dep
    [ -n "${loaded[$rel]:-}" ] && return
    loaded[$rel]=1
    for dep in $(awk -v m="$rel:" '$1 == m { $1 = ""; print }' "$l1_modules/modules.dep"); do
        add_module "$dep"
    done
    order+=("$rel")
}
for m in virt/lib/irqbypass drivers/crypto/ccp/ccp arch/x86/kvm/kvm arch/x86/kvm/kvm-amd \
    drivers/virtio/virtio_pci net/9p/9pnet_virtio fs/9p/9p drivers/net/tun drivers/net/veth; do
    add_module "kernel/$m.ko"
done
: >"$stage/lane/modules.order"
for rel in "${order[@]}"; do
    mkdir -p "$stage/lib/modules/$(dirname "$rel")"
    cp "$l1_modules/$rel" "$stage/lib/modules/$rel"
    case $(basename "$rel") in
        kvm-amd.ko) options="nested=1" ;;
        # The NX huge page recovery thread wakes a minute after a VM starts and zaps its
        # page tables across CPUs; under emulated SVM that wedged both L1 CPUs (soft
        # lockups, no progress). The mitigation is for Intel's iTLB multihit anyway.
        kvm.ko) options="nx_huge_pages=never" ;;
        *) options="" ;;
    esac
    echo "$rel $options" >>"$stage/lane/modules.order"
done
l1_initrd=$root/target/linux-lane-l1.cpio
(cd "$stage" && find . | LC_ALL=C sort | cpio -o -H newc --quiet) >"$l1_initrd"
log "L1 initramfs: $(du -h "$l1_initrd" | cut -f1), kernel $(basename "$l1_vmlinuz")"

# ---- one L1 boot: QEMU under a console watchdog
# Emulated SVM stalls or panics now and then (linux-lane.md): an L1 whose console shows no
# lane line (a heartbeat comes every 10 s) for $silence_limit s gets its registers dumped
# and is killed; the whole boot is retried once.
silence_limit=${AGENTVM_LANE_SILENCE_SECS:-90}
boot_limit=${AGENTVM_LANE_BOOT_SECS:-1500}

# Dumps the vCPUs' registers through the monitor, for the log of a hung L1.
dump_registers() {
    local port=$1 dump=$2
    if exec 3<>"/dev/tcp/127.0.0.1/$port"; then
        printf 'info registers -a\n' >&3
        timeout 5 cat <&3 >"$dump" || true
        exec 3<&-
    fi
}

# boot_l1 RUN_DIR CPU DONE ARGS…: 0 when the L1 ran to `LANE DONE`, 1 when it hung, crashed
# or ran out of time (a flake candidate). Scenario results are in RUN_DIR/results.jsonl; those
# that passed in DONE (an earlier boot's results.jsonl, or "") are carried over, not rerun.
boot_l1() {
    local dir=$1 cpu=$2 done=$3
    shift 3
    rm -rf "$dir" && mkdir -p "$dir"
    local args="$*"
    if [ -s "$done" ]; then
        cp "$done" "$dir/earlier.jsonl"
        args="$args --done /out/earlier.jsonl"
    fi
    echo "$args" >"$dir/lane.args"
    local port=$((20000 + RANDOM % 20000))
    qemu-system-x86_64 -accel tcg -cpu "$cpu" -smp 2 -m 6144 \
        -nodefaults -display none -no-reboot \
        -serial "file:$dir/l1-console.log" \
        -monitor "tcp:127.0.0.1:$port,server,nowait" \
        -virtfs "local,path=$dir,mount_tag=out,security_model=none,id=out" \
        -kernel "$l1_vmlinuz" -initrd "$l1_initrd" \
        -append "console=ttyS0 panic=-1 loglevel=5 nokaslr" &
    local qemu=$! started=$SECONDS last_size=-1 last_change=$SECONDS size verdict=""
    while kill -0 "$qemu" 2>/dev/null; do
        sleep 2
        # Progress is the lane's own lines: a wedged kernel keeps printing lockup reports.
        size=$(grep -c '^LANE ' "$dir/l1-console.log" 2>/dev/null || true)
        if [ "$size" != "$last_size" ]; then
            last_size=$size
            last_change=$SECONDS
        fi
        if [ $((SECONDS - last_change)) -ge "$silence_limit" ]; then
            verdict="console silent for ${silence_limit}s"
        elif [ $((SECONDS - started)) -ge "$boot_limit" ]; then
            verdict="still running after ${boot_limit}s"
        fi
        if [ -n "$verdict" ]; then
            log "$(basename "$dir"): $verdict; dumping registers and stopping it"
            dump_registers "$port" "$dir/l1-registers.txt"
            kill -9 "$qemu" 2>/dev/null || true
            break
        fi
    done
    wait "$qemu" 2>/dev/null || true
    if grep -q '^LANE DONE' "$dir/l1-console.log" 2>/dev/null; then
        return 0
    fi
    [ -n "$verdict" ] || verdict="QEMU exited before the lane finished$(grep -m1 -o 'Kernel panic.*' "$dir/l1-console.log" | sed 's/^/: /')"
    echo "$verdict" >"$dir/l1-verdict.txt"
    log "$(basename "$dir"): $verdict"
    return 1
}

# run_l1 NAME CPU ARGS…: a boot, and one reported retry if it hung or crashed.
results=()
run_l1() {
    local name=$1 cpu=$2
    shift 2
    local dir=$out/$name t0=$SECONDS
    log "$name: booting the L1 (-cpu $cpu)"
    if ! boot_l1 "$dir" "$cpu" "" "$@"; then
        rm -rf "$dir.flake" && mv "$dir" "$dir.flake"
        log "$name: FLAKE: the L1 did not finish ($(cat "$dir.flake/l1-verdict.txt")); logs in $dir.flake; retrying once with what did not pass yet"
        if ! boot_l1 "$dir" "$cpu" "$dir.flake/results.jsonl" "$@"; then
            log "$name: the retry did not finish either ($(cat "$dir/l1-verdict.txt"))"
            local why
            why="the L1 did not finish twice: $(cat "$dir.flake/l1-verdict.txt"); then $(cat "$dir/l1-verdict.txt")"
            why=${why//[\"\\]/\'}
            results+=("{\"name\":\"${name}/l1-boot\",\"passed\":false,\"seconds\":$((SECONDS - t0)),\"detail\":\"$why\"}")
        else
            local why="FLAKY: the first L1 boot did not finish ($(cat "$dir.flake/l1-verdict.txt"); logs in $name.flake/); the retry ran what had not passed and finished"
            why=${why//[\"\\]/\'}
            results+=("{\"name\":\"${name}/l1-boot\",\"passed\":true,\"seconds\":$((SECONDS - t0)),\"detail\":\"$why\"}")
        fi
    fi
    log "$name: L1 run took $((SECONDS - t0))s"
    if [ -f "$dir/results.jsonl" ]; then
        while IFS= read -r line; do results+=("$line"); done <"$dir/results.jsonl"
    fi
}

rm -rf "$out" && mkdir -p "$out"
runs=${AGENTVM_LANE_RUNS:-phys48 phys40}
[ -n "${CLOUD_HYPERVISOR:-}" ] && runs="$runs cloud-hypervisor"
for run in $runs; do
    case $run in
        # The lane's main machine: 48 physical address bits, XSAVE on. Every scenario, over two
        # L1 boots unless scenarios are named: an emulated L1 freezes now and then (RCU stalls
        # under TCG), and a shorter boot is less likely to and loses less when it does.
        phys48)
            if [ $# -gt 0 ]; then
                run_l1 phys48 max,phys-bits=48 --prefix phys48/ "$@"
            else
                run_l1 phys48 max,phys-bits=48 --prefix phys48/ --part 1/2
                run_l1 phys48b max,phys-bits=48 --prefix phys48/ --part 2/2
            fi ;;
        # A host with 40 address bits (the VMM's own memory must fit below them) and no
        # XSAVE (snapshots carry no XCRs): boot, memory-snapshot restore and fork there.
        phys40) run_l1 phys40 max,phys-bits=40,-xsave --prefix phys40/ \
            "${@:-testguest-turns echo-turns counter-suspend-resume fork-three-children}" ;;
        # The same sessions on a stock Cloud Hypervisor: turns, suspend and resume, fork (its
        # virtio-pci devices need the guest kernel's MSI; the test guest is MMIO-only).
        cloud-hypervisor) run_l1 cloud-hypervisor max,phys-bits=48 --prefix cloud-hypervisor/ \
            --vmm-flavour cloud-hypervisor \
            "${@:-echo-turns counter-suspend-resume fork-three-children}" ;;
        *) log "unknown run $run (phys48, phys40, cloud-hypervisor)"; exit 2 ;;
    esac
done

# ---- results
passed=0 failed=0
{
    echo '{"scenarios": ['
    sep=""
    for r in "${results[@]}"; do
        printf '%s  %s' "$sep" "$r"
        sep=$',\n'
    done
    printf '\n]}\n'
} >"$out/results.json"
for r in "${results[@]}"; do
    if [[ $r == *'"passed":true'* ]]; then
        passed=$((passed + 1))
        echo "  PASS $r"
    else
        failed=$((failed + 1))
        echo "  FAIL $r"
    fi
done
echo "lane: results in $out/results.json"
[ ${#results[@]} -gt 0 ] || { echo "lane: no scenario ran"; failed=$((failed + 1)); }
echo "lane: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
