//! COM1: a 16550A (vm-superio) whose output goes to a file, the VMM's stdout, or nowhere.
//!
//! The guest controls how much it prints, so output passes a token bucket: a burst of
//! `burst` bytes, then `rate` bytes a second. What does not fit is dropped and counted, so a
//! guest printing in a loop cannot fill the host's disk or log.

use std::fs::File;
use std::io::{self, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use vm_superio::serial::SerialEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use super::bus::BusDevice;

/// Raises an interrupt line through its irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

#[derive(Debug, Default)]
pub struct SerialStats {
    pub bytes_out: AtomicU64,
    pub bytes_dropped: AtomicU64,
}

impl SerialStats {
    pub fn counters(&self) -> [(&'static str, u64); 2] {
        [
            ("out_bytes", self.bytes_out.load(Ordering::Relaxed)),
            ("dropped_bytes", self.bytes_dropped.load(Ordering::Relaxed)),
        ]
    }
}

struct StatsEvents(Arc<SerialStats>);

impl SerialEvents for StatsEvents {
    fn buffer_read(&self) {}
    fn out_byte(&self) {}
    fn tx_lost_byte(&self) {
        self.0.bytes_dropped.fetch_add(1, Ordering::Relaxed);
    }
    fn in_buffer_empty(&self) {}
}

/// Where the guest's bytes end up.
pub enum Destination {
    Discard,
    Stdout,
    File(File),
}

/// Limits on serial output: a rate, and for a file the most it may ever hold (a guest
/// that prints for ever at the rate limit would otherwise fill the host's disk).
#[derive(Debug, Clone, Copy)]
pub struct RateLimit {
    pub burst: u64,
    pub rate_per_sec: u64,
    pub file_bytes: u64,
}

impl Default for RateLimit {
    fn default() -> Self {
        Self {
            burst: 1 << 20,
            rate_per_sec: 256 << 10,
            file_bytes: 16 << 20,
        }
    }
}

/// Written once, where a console file reaches its cap.
const CAPPED: &[u8] =
    b"\n[agentvm-vmm: the console reached its size cap; later output is dropped]\n";

/// Line-buffered, rate-limited output.
pub struct SerialOutput {
    destination: Destination,
    line: Vec<u8>,
    tokens: f64,
    limit: RateLimit,
    refilled: Instant,
    warned: bool,
    stats: Arc<SerialStats>,
    /// How much the destination file holds (its size when opened, then what was added).
    file_len: u64,
}

const LINE_MAX: usize = 4096;

impl SerialOutput {
    pub fn new(destination: Destination, limit: RateLimit, stats: Arc<SerialStats>) -> Self {
        // A restored VM appends to the console its snapshot's VM wrote.
        let file_len = match &destination {
            Destination::File(file) => file.metadata().map_or(0, |m| m.len()),
            _ => 0,
        };
        Self {
            file_len,
            destination,
            line: Vec::with_capacity(256),
            tokens: limit.burst as f64,
            limit,
            refilled: Instant::now(),
            warned: false,
            stats,
        }
    }

    fn admit(&mut self) -> bool {
        if self.tokens < 1.0 {
            let now = Instant::now();
            let elapsed = now.duration_since(self.refilled).as_secs_f64();
            self.tokens = (self.tokens + elapsed * self.limit.rate_per_sec as f64)
                .min(self.limit.burst as f64);
            self.refilled = now;
        }
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Pushes out a partial line: at pause, shutdown and drop.
    pub fn drain(&mut self) {
        if self.line.is_empty() {
            return;
        }
        let result = match &mut self.destination {
            Destination::Discard => Ok(()),
            Destination::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(&self.line).and_then(|()| out.flush())
            }
            Destination::File(file) => {
                let room = self
                    .limit
                    .file_bytes
                    .saturating_sub(self.file_len + CAPPED.len() as u64);
                if self.line.len() as u64 <= room {
                    self.file_len += self.line.len() as u64;
                    file.write_all(&self.line)
                } else {
                    self.stats
                        .bytes_dropped
                        .fetch_add(self.line.len() as u64, Ordering::Relaxed);
                    // The notice goes once: the file is at its cap from then on.
                    let notice = self.file_len + (CAPPED.len() as u64) <= self.limit.file_bytes;
                    self.file_len = self.limit.file_bytes;
                    self.line.clear();
                    match notice {
                        true => file.write_all(CAPPED),
                        false => Ok(()),
                    }
                }
            }
        };
        if let Err(e) = result {
            self.stats
                .bytes_dropped
                .fetch_add(self.line.len() as u64, Ordering::Relaxed);
            tracing::warn!(error = %e, "serial output could not be written");
        }
        self.line.clear();
    }
}

impl Write for SerialOutput {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        for &byte in bytes {
            if !self.admit() {
                self.stats.bytes_dropped.fetch_add(1, Ordering::Relaxed);
                if !self.warned {
                    self.warned = true;
                    tracing::warn!("guest serial output exceeds its rate limit; dropping bytes");
                }
                continue;
            }
            self.stats.bytes_out.fetch_add(1, Ordering::Relaxed);
            self.line.push(byte);
            if byte == b'\n' || self.line.len() >= LINE_MAX {
                self.drain();
            }
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        // vm-superio flushes after every byte; writing happens per line instead.
        Ok(())
    }
}

impl Drop for SerialOutput {
    fn drop(&mut self) {
        self.drain();
    }
}

/// The UART on the port bus.
pub struct SerialDevice {
    uart: Serial<IrqTrigger, StatsEvents, SerialOutput>,
}

impl SerialDevice {
    pub fn new(irq: EventFd, output: SerialOutput) -> Self {
        let stats = output.stats.clone();
        Self {
            uart: Serial::with_events(IrqTrigger(irq), StatsEvents(stats), output),
        }
    }

    /// A UART continuing from a snapshot's registers.
    pub fn restore(
        irq: EventFd,
        output: SerialOutput,
        state: &agentvm_snapshot::state::SerialState,
    ) -> Result<Self, String> {
        let stats = output.stats.clone();
        let state = vm_superio::serial::SerialState {
            baud_divisor_low: state.baud_divisor_low,
            baud_divisor_high: state.baud_divisor_high,
            interrupt_enable: state.interrupt_enable,
            interrupt_identification: state.interrupt_identification,
            line_control: state.line_control,
            line_status: state.line_status,
            modem_control: state.modem_control,
            modem_status: state.modem_status,
            scratch: state.scratch,
            in_buffer: state.in_buffer.clone(),
        };
        Serial::from_state(&state, IrqTrigger(irq), StatsEvents(stats), output)
            .map(|uart| Self { uart })
            .map_err(|e| format!("serial state: {e:?}"))
    }

    pub fn save(&self) -> agentvm_snapshot::state::SerialState {
        let s = self.uart.state();
        agentvm_snapshot::state::SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }

    pub fn drain(&mut self) {
        self.uart.writer_mut().drain();
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let (Ok(offset), [byte]) = (u8::try_from(offset), &mut *data) {
            *byte = self.uart.read(offset);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(offset), [byte]) = (u8::try_from(offset), data)
            && let Err(e) = self.uart.write(offset, *byte)
        {
            tracing::debug!(error = ?e, "serial write");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn output(file: File, limit: RateLimit) -> (SerialOutput, Arc<SerialStats>) {
        let stats = Arc::new(SerialStats::default());
        (
            SerialOutput::new(Destination::File(file), limit, stats.clone()),
            stats,
        )
    }

    #[test]
    fn writes_whole_lines_to_the_file() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        let (out, stats) = output(file.reopen().unwrap(), RateLimit::default());
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut dev = SerialDevice::new(irq, out);
        for b in b"hello\npartial" {
            dev.write(0, &[*b]);
        }
        let mut text = String::new();
        file.read_to_string(&mut text).unwrap();
        assert_eq!(text, "hello\n");
        dev.drain();
        file.read_to_string(&mut text).unwrap();
        assert_eq!(text, "hello\npartial");
        assert_eq!(stats.bytes_out.load(Ordering::Relaxed), 13);
    }

    #[test]
    fn flooding_guest_is_cut_off_and_counted() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        let limit = RateLimit {
            burst: 100,
            rate_per_sec: 1,
            ..RateLimit::default()
        };
        let (mut out, stats) = output(file.reopen().unwrap(), limit);
        out.write_all(&[b'x'; 10_000]).unwrap();
        out.drain();
        let mut text = Vec::new();
        file.read_to_end(&mut text).unwrap();
        assert!(text.len() <= 101, "{} bytes got through", text.len());
        assert!(stats.bytes_dropped.load(Ordering::Relaxed) >= 9_899);
    }

    /// Issue 33 (item 7): at the rate limit a guest still wrote 256 KiB/s to the host's
    /// disk for as long as it ran. A console file stops at its cap, says so once, and
    /// counts what it dropped; a reopened one (a restored VM) starts from what it holds.
    #[test]
    fn a_console_file_stops_at_its_cap() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        let limit = RateLimit {
            file_bytes: 1000,
            ..RateLimit::default()
        };
        let (mut out, stats) = output(file.reopen().unwrap(), limit);
        for _ in 0..100 {
            out.write_all(&[b'x'; 99]).unwrap();
            out.write_all(b"\n").unwrap();
        }
        drop(out);
        let mut text = Vec::new();
        file.read_to_end(&mut text).unwrap();
        assert!(text.len() <= 1000, "{} bytes", text.len());
        assert!(text.ends_with(CAPPED));
        assert_eq!(
            text.windows(CAPPED.len()).filter(|w| *w == CAPPED).count(),
            1
        );
        assert!(stats.bytes_dropped.load(Ordering::Relaxed) >= 9000);

        let (mut again, _) = output(file.reopen().unwrap(), limit);
        again.write_all(b"after a restore\n").unwrap();
        drop(again);
        let mut more = Vec::new();
        file.read_to_end(&mut more).unwrap();
        assert!(more.is_empty(), "a full console took {more:?}");
    }

    #[test]
    fn odd_sized_accesses_do_not_panic() {
        let (out, _) = output(tempfile::tempfile().unwrap(), RateLimit::default());
        let mut dev = SerialDevice::new(EventFd::new(libc::EFD_NONBLOCK).unwrap(), out);
        let mut wide = [0u8; 4];
        dev.read(0, &mut wide);
        assert_eq!(wide, [0xff; 4]);
        dev.write(u64::MAX, &[1]);
        dev.write(0, &[]);
    }
}
