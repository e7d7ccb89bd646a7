#!/bin/busybox sh
# /init of forkbox's emulated KVM host: load KVM and 9p, mount this
# machine's root read-only under an overlay (every host path visible,
# writes on the host's own scratch disk), chroot into it, run the command,
# power off.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /forkbox/modules.list); do
    insmod "$m" || echo "testbed: insmod $m failed"
done
run=$(sed -n 's/.*forkbox\.run=\([^ ]*\).*/\1/p' /proc/cmdline)
fail() { echo "testbed: $*"; poweroff -f; }
mkdir -p /lower /upper /host
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,ro,cache=loose hostroot /lower || fail "cannot mount the host root"
# The overlay's writes go to the scratch disk this machine made for this
# host (ext4, sparse, deleted with it): what VMs write to files (their
# writable disks' tops) is written back and dropped, as on a real host,
# instead of filling RAM.
if [ -b /dev/vda ]; then
    mount -t ext4 -o noatime,noinit_itable /dev/vda /upper || fail "cannot mount the scratch disk"
else
    echo "testbed: warning: no scratch disk: writes stay in RAM"
    mount -t tmpfs tmpfs /upper
fi
mkdir -p /upper/data /upper/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /host || fail "cannot mount the overlay root"
mount -t proc proc /host/proc
mount -t sysfs sysfs /host/sys
# cgroup v2, as on a systemd host: each VMM gets a cgroup of its own.
# favordynmods: moving a fork child into its cgroup costs no RCU grace
# period (docs/SPEC.md, "A cgroup per VMM").
mount -t cgroup2 -o favordynmods cgroup2 /host/sys/fs/cgroup || echo "testbed: warning: no cgroup v2"
# KVM's counters per VM (nested-page faults, exits), which `forkbox bench
# fork` reads for each child.
mount -t debugfs debugfs /host/sys/kernel/debug || echo "testbed: warning: no debugfs (KVM's counters unread)"
mount -t devtmpfs devtmpfs /host/dev
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs tmpfs /host/dev/shm
mount -t tmpfs tmpfs /host/run
mkdir -p "/host$run"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 rundir "/host$run" || fail "cannot mount the run directory"
# A directory shared writable (RunOptions::share); uncached, so what the
# command writes is on this machine's disk even if the emulated host dies.
share=$(sed -n 's/.*forkbox\.share=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ -n "$share" ]; then
    mkdir -p "/host$share"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 share "/host$share" || fail "cannot mount the shared directory"
fi
[ -e /dev/kvm ] || echo "testbed: warning: no /dev/kvm (kvm_amd did not load)"
# No page migration on the host's own initiative: no proactive compaction,
# and no compaction to make a huge page (one is used where free). Every
# migrated guest page means a nested-page-table invalidation, the path
# suspected, not shown, in the guests' triple faults here (docs/SPEC.md).
echo 0 >/proc/sys/vm/compaction_proactiveness || echo "testbed: cannot turn proactive compaction off"
echo never >/sys/kernel/mm/transparent_hugepage/defrag || echo "testbed: cannot turn huge-page defrag off"
# Zygote memory asks for 2 MiB pages where it is dense (docs/SPEC.md, "Huge
# pages for zygote memory"); memfds get them only with `advise` or more. Set
# here, not left to the first VMM, so the trials that check them run on a
# known setting (and fail saying so if it could not be set).
echo advise >/sys/kernel/mm/transparent_hugepage/shmem_enabled || echo "testbed: cannot set shmem huge pages to advise"
# Loopback up: tests serve on 127.0.0.1 for their guests (host.forkbox.internal).
ip link set lo up || echo "testbed: cannot bring lo up"
# A watchdog on the serial console, for runs that stall: every 5 minutes a
# heartbeat (a missing one means this kernel itself stopped), and the kernel
# stack of any process blocked (state D) two checks running, once each.
watchdog() {
    beats=0 prev="" told=""
    while sleep 60; do
        beats=$((beats + 1)) now=""
        for stat in /proc/[0-9]*/stat; do
            { read -r line <"$stat"; } 2>/dev/null || continue
            rest=${line##*) }
            [ "${rest%% *}" = D ] || continue
            pid=${stat#/proc/} pid=${pid%/stat}
            now="$now $pid"
            case " $prev " in *" $pid "*) ;; *) continue ;; esac
            case " $told " in *" $pid "*) continue ;; esac
            told="$told $pid"
            echo "testbed: pid $pid ($(cat /proc/$pid/comm 2>/dev/null)) blocked over a minute, in $(cat /proc/$pid/wchan 2>/dev/null):"
            cat "/proc/$pid/stack" 2>/dev/null
        done
        prev=$now
        if [ $((beats % 5)) -eq 0 ]; then
            echo "testbed: alive, up $(cut -d' ' -f1 /proc/uptime) s, load $(cut -d' ' -f1-3 /proc/loadavg)"
        fi
    done
}
watchdog >/dev/console 2>&1 &
chroot /host /bin/sh "$run/cmd.sh" >"/host$run/stdout" 2>"/host$run/stderr" </dev/null
echo $? >"/host$run/status"
sync
poweroff -f
