//! One running VM, assembled from a [`VmSpec`]: RAM, KVM, the kernel in memory, devices on
//! their buses, and the vCPU threads. The only place a VM is built; `persist` builds one
//! from a snapshot instead and writes snapshots.

mod checkpoint;
mod persist;

pub use checkpoint::CHECKPOINT_DEPTH;
pub use persist::{FLATTEN_AT, PersistError, RestoreSpec, SaveKind, SaveReport};

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentvm_vmm_api::config::MAX_DISKS;
use kvm_ioctls::{IoEventAddress, VcpuFd};
use vmm_sys_util::eventfd::EventFd;

use crate::boot::loader::{self, EntryPoint, LoadError};
use crate::boot::params::{self, ParamsError};
use crate::boot::{layout, mptable};
use crate::devices::bus::{Bus, Overlap};
use crate::devices::i8042::{self, I8042};
use crate::devices::serial::{Destination, RateLimit, SerialDevice, SerialOutput, SerialStats};
use crate::devices::virtio::block::{Block, BlockError, BlockHandler, BlockStats};
use crate::devices::virtio::mmio::{self, MmioError, VirtioMmio};
use crate::devices::virtio::net::tap::TapError;
use crate::devices::virtio::net::{self as virtio_net, Net, NetHandler, NetParams, NetStats};
use crate::devices::virtio::vsock::muxer::Muxer;
use crate::devices::virtio::vsock::{Vsock, VsockHandler, VsockStats};
use crate::devices::virtio::{Interrupt, VirtioDevice};
use crate::event_loop::{EventLoop, EventLoopError, Subscriber};
use crate::exit::ExitSignal;
use crate::kvm::memory::{GuestRam, MemoryError, RamOptions};
use crate::kvm::vcpu::{VcpuContext, VcpuError, VcpuSet, VcpuStats};
use crate::kvm::vm::{KvmVm, VmError};
use crate::kvm::{cpuid, regs};

/// Everything needed to build a VM, already validated by the API layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmSpec {
    pub vcpus: u8,
    pub memory_bytes: u64,
    pub ram: RamSpec,
    pub kernel: PathBuf,
    pub initramfs: Option<PathBuf>,
    pub cmdline: String,
    pub serial: SerialSpec,
    pub vsock: Option<VsockSpec>,
    /// virtio-blk disks, in the order the guest finds them.
    pub disks: Vec<DiskSpec>,
    /// virtio-net devices, in config order.
    pub nets: Vec<NetSpec>,
    /// Where guest RAM files live (a tmpfs); `None` for a memfd.
    pub ram_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSpec {
    pub path: PathBuf,
    pub read_only: bool,
    /// What GET_ID answers (the guest's serial for it).
    pub serial: String,
}

/// virtio-mmio window of the `index`th disk: vsock keeps window 0 whether it is there or not,
/// so a disk's window (and the guest's view of it) never depends on the vsock device.
pub fn disk_window(index: usize) -> u32 {
    1 + index as u32
}

/// A network device: the tap it attaches to and what the guest sees of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetSpec {
    /// Device id (`_net0` unless the config names one): the key of its counters.
    pub id: String,
    pub tap: String,
    pub params: NetParams,
}

/// virtio-mmio window of the `index`th network device: after every disk window, used or
/// not, so neither a disk's nor a NIC's address depends on how many of the other there are.
pub fn net_window(index: usize) -> u32 {
    1 + MAX_DISKS as u32 + index as u32
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockSpec {
    pub cid: u32,
    /// Host unix socket we bind; guest-initiated streams to port P dial `<socket>_P`.
    pub socket: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RamSpec {
    pub prefault: bool,
    pub mergeable: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SerialSpec {
    /// No UART at all.
    Off,
    /// A UART whose output is discarded.
    Null,
    /// The VMM's standard output.
    Stdout,
    File(PathBuf),
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Kvm(#[from] VmError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Params(#[from] ParamsError),
    #[error(transparent)]
    MpTable(#[from] mptable::MpTableError),
    #[error(transparent)]
    Regs(#[from] regs::RegsError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("{what} failed: {source}")]
    KvmIoctl {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("device layout: {0}")]
    Layout(#[from] Overlap),
    #[error(transparent)]
    Virtio(#[from] MmioError),
    #[error(transparent)]
    EventLoop(#[from] EventLoopError),
    #[error("vsock socket {path}: {source}")]
    VsockSocket {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Disk(#[from] BlockError),
    #[error("net[{index}].tap {tap:?}: {source}")]
    Tap {
        index: usize,
        tap: String,
        source: TapError,
    },
    #[error("restoring device state: {0}")]
    State(String),
    #[error(transparent)]
    KvmState(#[from] crate::kvm::state::StateError),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BuildError {
    let what = what.into();
    move |source| BuildError::Io { what, source }
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> BuildError {
    move |source| BuildError::KvmIoctl { what, source }
}

/// How long a pause may take before we call the vCPUs stuck.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Vm {
    // Field order is drop order: threads first, then the KVM fds, then the RAM they map.
    vcpus: VcpuSet,
    devices: EventLoop,
    serial: Option<Arc<Mutex<SerialDevice>>>,
    vsock: Option<AttachedVsock>,
    disks: Vec<AttachedDisk>,
    nets: Vec<AttachedNet>,
    exit: Arc<ExitSignal>,
    serial_stats: Arc<SerialStats>,
    vcpu_stats: Arc<VcpuStats>,
    kvm: KvmVm,
    ram: GuestRam,
    booted: Instant,
    /// The MSRs a snapshot saves, probed on first use.
    msrs: std::sync::OnceLock<Vec<u32>>,
    /// The last checkpoints taken, newest last: the next is layered on the newest.
    checkpoints: std::collections::VecDeque<checkpoint::TakenCheckpoint>,
}

/// What a VM is built from before KVM is involved.
struct Parts {
    ram: GuestRam,
    vsock: Option<AttachedVsock>,
    disks: Vec<AttachedDisk>,
    nets: Vec<AttachedNet>,
    serial: Option<SerialParts>,
    serial_stats: Arc<SerialStats>,
}

/// A VM whose vCPUs and devices have stopped, holding its KVM VM and RAM until dropped.
pub struct Halted {
    _vm: Vm,
}

impl Vm {
    /// Builds the VM and starts its vCPUs. `kvm` yields the KVM VM (typically one prepared
    /// ahead of time); it is asked for only once everything that does not need it is done, so
    /// a VM still being prepared overlaps with loading the kernel and building devices.
    pub fn boot(
        spec: &VmSpec,
        kvm: impl FnOnce() -> Result<KvmVm, VmError>,
    ) -> Result<Self, BuildError> {
        let ram = GuestRam::new(
            spec.memory_bytes,
            RamOptions {
                prefault: spec.ram.prefault,
                mergeable: spec.ram.mergeable,
            },
            spec.ram_dir.as_deref(),
        )?;
        let mut cmdline = spec.cmdline.clone();
        let vsock = match &spec.vsock {
            Some(vsock_spec) => {
                append_device(&mut cmdline, 0);
                Some(create_vsock(&ram, vsock_spec, None)?)
            }
            None => None,
        };
        let disks = spec
            .disks
            .iter()
            .enumerate()
            .map(|(i, disk)| {
                append_device(&mut cmdline, disk_window(i));
                create_disk(&ram, disk, None, None)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let nets = spec
            .nets
            .iter()
            .enumerate()
            .map(|(i, net)| {
                append_device(&mut cmdline, net_window(i));
                create_net(&ram, i, net, None)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let entry = load_guest(&ram, spec, &cmdline)?;
        let stats = Arc::new(SerialStats::default());
        let serial = serial_device(spec, stats.clone(), None)?;
        let parts = Parts {
            ram,
            vsock,
            disks,
            nets,
            serial,
            serial_stats: stats,
        };
        Self::assemble(
            parts,
            kvm,
            |kvm, ram| create_vcpus(kvm, ram, spec.vcpus, entry),
            false,
        )
    }

    /// Puts the VM together from its parts: RAM into the KVM VM, devices on their buses and
    /// interrupt lines, the device thread, and the vCPUs `vcpus` creates (running, or parked
    /// until `resume` when `paused`).
    fn assemble(
        parts: Parts,
        kvm: impl FnOnce() -> Result<KvmVm, VmError>,
        vcpus: impl FnOnce(&KvmVm, &GuestRam) -> Result<Vec<VcpuFd>, BuildError>,
        paused: bool,
    ) -> Result<Self, BuildError> {
        let started = Instant::now();
        let Parts {
            ram,
            vsock,
            disks,
            nets,
            serial,
            serial_stats,
        } = parts;
        let exit = Arc::new(ExitSignal::new().map_err(io("creating the exit eventfd"))?);
        let mut kvm = kvm()?;
        kvm.map_ram(&ram)?;
        let mut pio = Bus::default();
        let mut mmio = Bus::default();
        let mut subscribers: Vec<Box<dyn Subscriber>> = Vec::new();
        if let Some(vsock) = &vsock {
            connect_virtio(
                &kvm,
                &vsock.device,
                0,
                &mut mmio,
                ["KVM_IRQFD (vsock)", "KVM_IOEVENTFD (vsock)"],
            )?;
            subscribers.push(Box::new(
                VsockHandler::new(vsock.device.clone())
                    .map_err(io("cloning vsock queue eventfds"))?,
            ));
        }
        for (i, disk) in disks.iter().enumerate() {
            connect_virtio(
                &kvm,
                &disk.device,
                disk_window(i),
                &mut mmio,
                ["KVM_IRQFD (disk)", "KVM_IOEVENTFD (disk)"],
            )?;
            subscribers.push(Box::new(
                BlockHandler::new(disk.device.clone())
                    .map_err(io("cloning a disk's queue eventfd"))?,
            ));
        }
        for (i, net) in nets.iter().enumerate() {
            connect_virtio(
                &kvm,
                &net.device,
                net_window(i),
                &mut mmio,
                ["KVM_IRQFD (net)", "KVM_IOEVENTFD (net)"],
            )?;
            subscribers.push(Box::new(
                NetHandler::new(net.device.clone())
                    .map_err(io("cloning a network device's queue eventfds"))?,
            ));
        }
        let serial = match serial {
            Some((device, irq)) => {
                kvm.fd
                    .register_irqfd(&irq, layout::SERIAL_IRQ)
                    .map_err(ioctl("KVM_IRQFD (serial)"))?;
                pio.insert(
                    u64::from(layout::SERIAL_PORT_BASE),
                    u64::from(layout::SERIAL_PORT_LEN),
                    device.clone(),
                )?;
                Some(device)
            }
            None => None,
        };
        pio.insert(
            u64::from(layout::I8042_DATA_PORT),
            i8042::WINDOW_LEN,
            Arc::new(Mutex::new(I8042::new(exit.clone()))),
        )?;
        let vcpu_fds = vcpus(&kvm, &ram)?;
        let devices = EventLoop::start(subscribers)?;
        if paused {
            devices.pause()?;
        }
        let vcpu_stats = Arc::new(VcpuStats::default());
        let vcpus = VcpuSet::start(
            vcpu_fds,
            VcpuContext {
                pio: Arc::new(pio),
                mmio: Arc::new(mmio),
                exit: exit.clone(),
                stats: vcpu_stats.clone(),
            },
            paused,
        )?;
        tracing::debug!(elapsed = ?started.elapsed(), "VM assembled");
        Ok(Self {
            vcpus,
            devices,
            serial,
            vsock,
            disks,
            nets,
            exit,
            serial_stats,
            vcpu_stats,
            kvm,
            ram,
            booted: started,
            msrs: std::sync::OnceLock::new(),
            checkpoints: std::collections::VecDeque::new(),
        })
    }

    pub fn exit_signal(&self) -> &Arc<ExitSignal> {
        &self.exit
    }

    /// Stops the vCPUs, then the devices, so neither touches guest RAM until `resume`.
    pub fn pause(&self) -> Result<(), PauseError> {
        self.vcpus.pause(PAUSE_TIMEOUT)?;
        if let Err(e) = self.devices.pause() {
            self.vcpus.resume();
            return Err(e.into());
        }
        self.drain_serial();
        Ok(())
    }

    pub fn resume(&self) -> Result<(), PauseError> {
        self.devices.resume()?;
        self.vcpus.resume();
        Ok(())
    }

    /// Whether its vCPUs run (a fork with `resume` may have resumed a paused VM, even when
    /// it failed afterwards).
    pub fn running(&self) -> bool {
        self.vcpus.running()
    }

    /// Stops the vCPUs and the devices and releases everything the VM holds.
    pub fn stop(self) {
        drop(self.halt());
    }

    /// Stops the vCPUs and the devices; what the VM holds (its KVM VM, its RAM) is released
    /// when the returned value is dropped.
    pub fn halt(mut self) -> Halted {
        self.vcpus.stop();
        self.devices.stop();
        self.drain_serial();
        Halted { _vm: self }
    }

    pub fn memory_size(&self) -> u64 {
        self.ram.size()
    }

    pub fn uptime(&self) -> Duration {
        self.booted.elapsed()
    }

    pub fn kvm(&self) -> &KvmVm {
        &self.kvm
    }

    /// Counters per device, as `vm.counters` reports them.
    pub fn counters(&self) -> BTreeMap<String, BTreeMap<String, u64>> {
        let mut all = BTreeMap::new();
        let collect = |pairs: &[(&'static str, u64)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect::<BTreeMap<_, _>>()
        };
        all.insert("vcpus".to_owned(), collect(&self.vcpu_stats.counters()));
        if let Some(vsock) = &self.vsock {
            let mut counters = collect(&vsock.stats.counters());
            let open = lock_vsock(&vsock.device)
                .device()
                .muxer()
                .connection_count();
            counters.insert("connections_open".to_owned(), open as u64);
            all.insert("_vsock0".to_owned(), counters);
        }
        if self.serial.is_some() {
            all.insert("_serial".to_owned(), collect(&self.serial_stats.counters()));
        }
        for (i, disk) in self.disks.iter().enumerate() {
            all.insert(format!("_disk{i}"), disk_counters(&disk.stats));
        }
        for net in &self.nets {
            all.insert(net.id.clone(), collect(&net.stats.counters()));
        }
        all
    }

    /// Appends `rules` to the egress policy of network device `index`; the next frame is
    /// judged by them.
    pub fn egress_allow(
        &self,
        index: usize,
        rules: &[agentvm_vmm_api::config::ParsedRule],
    ) -> Result<(), EgressAllowError> {
        self.with_net(index, |net| net.allow_egress(rules))
    }

    /// Takes `rules` out of the egress policy of network device `index`; flows its guest
    /// already opened stay open.
    pub fn egress_revoke(
        &self,
        index: usize,
        rules: &[agentvm_vmm_api::config::ParsedRule],
    ) -> Result<(), EgressAllowError> {
        self.with_net(index, |net| net.revoke_egress(rules))
    }

    /// Runs `change` on network device `index`'s device, under its lock.
    fn with_net(
        &self,
        index: usize,
        change: impl FnOnce(&mut virtio_net::Net) -> Result<(), virtio_net::EgressAllowError>,
    ) -> Result<(), EgressAllowError> {
        let net = self.nets.get(index).ok_or(EgressAllowError::NoDevice)?;
        change(virtio_net::lock(&net.device).device_mut()).map_err(EgressAllowError::Device)
    }

    fn drain_serial(&self) {
        if let Some(serial) = &self.serial {
            serial.lock().unwrap_or_else(|p| p.into_inner()).drain();
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EgressAllowError {
    #[error("the VM has no such network device")]
    NoDevice,
    #[error(transparent)]
    Device(virtio_net::EgressAllowError),
}

#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error(transparent)]
    Vcpus(#[from] VcpuError),
    #[error(transparent)]
    Devices(#[from] EventLoopError),
}

struct AttachedVsock {
    device: Arc<Mutex<VirtioMmio<Vsock>>>,
    stats: Arc<VsockStats>,
    _socket: BoundSocket,
}

/// The vsock socket path we bound. Removed when the VM goes away, or when building it fails
/// half-way, so a path never stays taken by a VM that does not exist (Cloud Hypervisor
/// unlinks it the same way).
struct BoundSocket(PathBuf);

impl Drop for BoundSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn lock_vsock(device: &Mutex<VirtioMmio<Vsock>>) -> std::sync::MutexGuard<'_, VirtioMmio<Vsock>> {
    device.lock().unwrap_or_else(|p| p.into_inner())
}

/// Announces virtio-mmio device `index` to the guest kernel, Firecracker style.
fn append_device(cmdline: &mut String, index: u32) {
    let (base, size) = layout::virtio_mmio_window(index);
    let irq = layout::VIRTIO_IRQ_BASE + index;
    if !cmdline.is_empty() {
        cmdline.push(' ');
    }
    cmdline.push_str(&format!(
        "virtio_mmio.device={}K@{base:#x}:{irq}",
        size >> 10
    ));
}

/// The vsock device: its host socket bound, the device model behind a virtio-mmio transport
/// (fresh, or continuing from a snapshot's transport state).
fn create_vsock(
    ram: &GuestRam,
    spec: &VsockSpec,
    saved: Option<&agentvm_snapshot::state::VirtioMmioState>,
) -> Result<AttachedVsock, BuildError> {
    let socket_error = |source| BuildError::VsockSocket {
        path: spec.socket.display().to_string(),
        source,
    };
    let listener = UnixListener::bind(&spec.socket).map_err(socket_error)?;
    let bound = BoundSocket(spec.socket.clone());
    let stats = Arc::new(VsockStats::default());
    let muxer = Muxer::new(u64::from(spec.cid), &spec.socket, listener, stats.clone())
        .map_err(socket_error)?;
    let irqfd = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
        .map_err(io("creating the vsock irqfd"))?;
    let device = Vsock::new(u64::from(spec.cid), muxer);
    let interrupt = Interrupt::new(irqfd);
    let transport = match saved {
        Some(state) => VirtioMmio::restore(device, ram.shared_memory(), interrupt, state)?,
        None => VirtioMmio::new(device, ram.shared_memory(), interrupt)?,
    };
    Ok(AttachedVsock {
        device: Arc::new(Mutex::new(transport)),
        stats,
        _socket: bound,
    })
}

/// Makes `device` virtio-mmio device `index`: its interrupt line and queue-notify eventfds
/// registered with KVM, its registers on the MMIO bus.
fn connect_virtio<D: VirtioDevice + 'static>(
    kvm: &KvmVm,
    device: &Arc<Mutex<VirtioMmio<D>>>,
    index: u32,
    mmio: &mut Bus,
    [irqfd_call, ioevent_call]: [&'static str; 2],
) -> Result<(), BuildError> {
    let transport = device.lock().unwrap_or_else(|p| p.into_inner());
    kvm.fd
        .register_irqfd(
            transport.interrupt().irqfd(),
            layout::VIRTIO_IRQ_BASE + index,
        )
        .map_err(ioctl(irqfd_call))?;
    let (base, size) = layout::virtio_mmio_window(index);
    for (queue, event) in transport.queue_events().iter().enumerate() {
        // Notifications then wake the device thread straight from KVM, without a trip
        // through a vCPU thread.
        kvm.fd
            .register_ioevent(
                event,
                &IoEventAddress::Mmio(base + mmio::NOTIFY_OFFSET),
                queue as u32,
            )
            .map_err(ioctl(ioevent_call))?;
    }
    drop(transport);
    mmio.insert(base, size, device.clone())?;
    Ok(())
}

struct AttachedDisk {
    device: Arc<Mutex<VirtioMmio<Block>>>,
    stats: Arc<BlockStats>,
}

fn lock_disk(device: &Mutex<VirtioMmio<Block>>) -> std::sync::MutexGuard<'_, VirtioMmio<Block>> {
    device.lock().unwrap_or_else(|p| p.into_inner())
}

/// A disk: its file opened, the device model behind a virtio-mmio transport (fresh, or
/// continuing from a snapshot's transport state).
fn create_disk(
    ram: &GuestRam,
    spec: &DiskSpec,
    saved: Option<&agentvm_snapshot::state::VirtioMmioState>,
    layers: Option<&[PathBuf]>,
) -> Result<AttachedDisk, BuildError> {
    let block = match layers {
        Some(layers) => Block::open_layered(&spec.path, &spec.serial, layers)?,
        None => Block::open(&spec.path, spec.read_only, &spec.serial)?,
    };
    let stats = block.stats();
    let irqfd = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
        .map_err(io("creating a disk's irqfd"))?;
    let interrupt = Interrupt::new(irqfd);
    let transport = match saved {
        Some(state) => VirtioMmio::restore(block, ram.shared_memory(), interrupt, state)?,
        None => VirtioMmio::new(block, ram.shared_memory(), interrupt)?,
    };
    Ok(AttachedDisk {
        device: Arc::new(Mutex::new(transport)),
        stats,
    })
}

struct AttachedNet {
    id: String,
    device: Arc<Mutex<VirtioMmio<Net>>>,
    stats: Arc<NetStats>,
}

/// Network device `index`: its tap attached, the device model behind a virtio-mmio
/// transport (fresh, or continuing from a snapshot's transport state). A restored device
/// starts with no flow remembered: nothing its VM had open before the snapshot is let in.
fn create_net(
    ram: &GuestRam,
    index: usize,
    spec: &NetSpec,
    saved: Option<&agentvm_snapshot::state::VirtioMmioState>,
) -> Result<AttachedNet, BuildError> {
    let backend = virtio_net::tap::open(&spec.tap).map_err(|source| BuildError::Tap {
        index,
        tap: spec.tap.clone(),
        source,
    })?;
    let net = Net::new(backend, &spec.params);
    let stats = net.stats();
    let irqfd = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
        .map_err(io("creating a network device's irqfd"))?;
    let interrupt = Interrupt::new(irqfd);
    let transport = match saved {
        Some(state) => VirtioMmio::restore(net, ram.shared_memory(), interrupt, state)?,
        None => VirtioMmio::new(net, ram.shared_memory(), interrupt)?,
    };
    Ok(AttachedNet {
        id: spec.id.clone(),
        device: Arc::new(Mutex::new(transport)),
        stats,
    })
}

fn disk_counters(stats: &BlockStats) -> BTreeMap<String, u64> {
    use std::sync::atomic::Ordering::Relaxed;
    [
        ("read_ops", stats.reads.load(Relaxed)),
        ("read_bytes", stats.read_bytes.load(Relaxed)),
        ("write_ops", stats.writes.load(Relaxed)),
        ("write_bytes", stats.written_bytes.load(Relaxed)),
        ("flush_ops", stats.flushes.load(Relaxed)),
        ("errors", stats.errors.load(Relaxed)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// Kernel, initramfs, command line, boot parameters and MP table into RAM.
fn load_guest(ram: &GuestRam, spec: &VmSpec, cmdline: &str) -> Result<EntryPoint, BuildError> {
    let memory = ram.memory();
    let kernel = loader::load_kernel(memory, &spec.kernel)?;
    let low_ram_end = ram.ranges()[0].1;
    let initrd = spec
        .initramfs
        .as_deref()
        .map(|path| loader::load_initrd(memory, path, kernel.kernel_end, low_ram_end))
        .transpose()?;
    loader::write_cmdline(memory, cmdline)?;
    let map = params::memory_map(&ram.ranges());
    match kernel.entry {
        EntryPoint::Pvh { .. } => params::write_pvh(memory, &map, cmdline.len(), initrd)?,
        EntryPoint::Linux64 { setup_header, .. } => {
            params::write_zero_page(memory, &map, cmdline.len(), initrd, setup_header)?
        }
    }
    mptable::write(memory, spec.vcpus)?;
    Ok(kernel.entry)
}

/// The UART and the irqfd its interrupt line needs registered.
type SerialParts = (Arc<Mutex<SerialDevice>>, EventFd);

fn serial_device(
    spec: &VmSpec,
    stats: Arc<SerialStats>,
    saved: Option<&agentvm_snapshot::state::SerialState>,
) -> Result<Option<SerialParts>, BuildError> {
    let destination = match &spec.serial {
        SerialSpec::Off => return Ok(None),
        SerialSpec::Null => Destination::Discard,
        SerialSpec::Stdout => Destination::Stdout,
        SerialSpec::File(path) => Destination::File(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(io(format!("opening serial file {}", path.display())))?,
        ),
    };
    let irq = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
        .map_err(io("creating the serial irqfd"))?;
    let registered = irq.try_clone().map_err(io("cloning the serial irqfd"))?;
    let output = SerialOutput::new(destination, RateLimit::default(), stats);
    let device = match saved {
        Some(state) => SerialDevice::restore(irq, output, state).map_err(BuildError::State)?,
        None => SerialDevice::new(irq, output),
    };
    Ok(Some((Arc::new(Mutex::new(device)), registered)))
}

fn create_vcpus(
    kvm: &KvmVm,
    ram: &GuestRam,
    count: u8,
    entry: EntryPoint,
) -> Result<Vec<VcpuFd>, BuildError> {
    let supported = kvm.supported_cpuid();
    let mut vcpus = Vec::with_capacity(usize::from(count));
    for index in 0..count {
        let vcpu = kvm
            .fd
            .create_vcpu(u64::from(index))
            .map_err(ioctl("KVM_CREATE_VCPU"))?;
        vcpu.set_cpuid2(&cpuid::for_vcpu(supported, index, count))
            .map_err(ioctl("KVM_SET_CPUID2"))?;
        regs::setup_msrs(&vcpu)?;
        regs::setup_lapic(&vcpu)?;
        // Secondary vCPUs wait for INIT/SIPI from the boot CPU; only it gets an entry state.
        if index == 0 {
            regs::setup_fpu(&vcpu)?;
            regs::setup_sregs(ram.memory(), &vcpu, entry)?;
            regs::setup_regs(&vcpu, entry)?;
        }
        vcpus.push(vcpu);
    }
    Ok(vcpus)
}
