#!/bin/busybox sh
# /init of the Linux lane's L1 (tests/linux/run.sh packs it). Stage 1 copies the initramfs
# into a tmpfs and switch_roots into it: agentvmd's VMM jail uses pivot_root, which the
# initramfs rootfs cannot do. Stage 2 mounts what agentvmd needs, loads KVM (AMD, nested),
# mounts the host's results directory (9p) and runs agentvm-lane with the arguments the host
# left there. The console carries progress, a heartbeat for the host's watchdog, and the
# closing `LANE DONE exit=N`.
PATH=/bin:/sbin

if [ "$1" != stage2 ]; then
    /bin/busybox mkdir -p /sbin /usr/bin /usr/sbin /proc /newroot
    /bin/busybox --install -s /bin
    mount -t proc proc /proc
    mount -t tmpfs -o mode=0755 root /newroot
    for entry in /bin /sbin /usr /lane /lib /lib64 /init; do
        cp -a "$entry" /newroot/
    done
    umount /proc
    exec switch_root /newroot /init stage2
fi

mkdir -p /proc /sys /dev /tmp /run /var/lib /out
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/shm /dev/pts /sys/fs/cgroup
mount -t tmpfs -o mode=1777 shm /dev/shm
mount -t tmpfs -o mode=1777 tmp /tmp
mount -t tmpfs -o mode=0755 run /run
mount -t cgroup2 cgroup2 /sys/fs/cgroup
echo "LANE L1 up at $(cut -d' ' -f1 /proc/uptime)s"

# The host's watchdog kills an L1 whose console stays silent: this keeps a live one talking.
(while :; do sleep 10; echo "LANE HEARTBEAT $(cut -d' ' -f1 /proc/uptime)s"; done) &

while read -r module options; do
    # shellcheck disable=SC2086
    insmod "/lib/modules/$module" $options || echo "LANE insmod $module failed"
done </lane/modules.order
if [ ! -c /dev/kvm ]; then
    echo "LANE no /dev/kvm after loading kvm-amd"
fi
echo "LANE kvm_amd nested=$(cat /sys/module/kvm_amd/parameters/nested 2>/dev/null) npt=$(cat /sys/module/kvm_amd/parameters/npt 2>/dev/null)"

rc=1
if mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 out /out; then
    # For symbolizing a hung L1's register dump (the kernel runs with nokaslr).
    cp /proc/kallsyms /out/l1-kallsyms.txt 2>/dev/null
    # shellcheck disable=SC2046
    /lane/bin/agentvm-lane --bin-dir /lane/bin --images /lane/images --state-dir /var/lib/lane \
        --out /out $(cat /out/lane.args)
    rc=$?
    cp /proc/cpuinfo /out/l1-cpuinfo.txt 2>/dev/null
    dmesg >/out/l1-dmesg.txt 2>/dev/null
    sync
    umount /out
else
    echo "LANE cannot mount the results share"
fi
echo "LANE DONE exit=$rc"
poweroff -f
