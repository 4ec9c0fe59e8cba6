//! Address decoding for port I/O and MMIO exits: a sorted list of ranges, each owned by one
//! device. Built before the vCPUs start and never changed while they run.

use std::sync::{Arc, Mutex};

/// A device that answers guest reads and writes in its address window.
pub trait BusDevice: Send {
    /// `offset` is relative to the start of the device's window.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

#[derive(Debug, thiserror::Error)]
#[error("bus range {base:#x}+{len:#x} overlaps an existing device")]
pub struct Overlap {
    pub base: u64,
    pub len: u64,
}

#[derive(Clone, Default)]
pub struct Bus {
    ranges: Vec<(u64, u64, SharedDevice)>,
}

impl Bus {
    pub fn insert(&mut self, base: u64, len: u64, device: SharedDevice) -> Result<(), Overlap> {
        let end = base.checked_add(len).ok_or(Overlap { base, len })?;
        if len == 0 || self.ranges.iter().any(|(b, l, _)| base < b + l && *b < end) {
            return Err(Overlap { base, len });
        }
        let at = self.ranges.partition_point(|(b, _, _)| *b < base);
        self.ranges.insert(at, (base, len, device));
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(&SharedDevice, u64)> {
        let at = self.ranges.partition_point(|(b, _, _)| *b <= addr);
        let (base, len, device) = self.ranges.get(at.checked_sub(1)?)?;
        let offset = addr - base;
        // The whole access must fall inside the window.
        (offset + size as u64 <= *len).then_some((device, offset))
    }

    /// Returns false when no device claims the access; the caller decides what the guest sees.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((device, offset)) => {
                lock(device).read(offset, data);
                true
            }
            None => false,
        }
    }

    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((device, offset)) => {
                lock(device).write(offset, data);
                true
            }
            None => false,
        }
    }
}

/// A device whose lock was poisoned by a panic still serves: its state is plain registers.
fn lock(device: &SharedDevice) -> std::sync::MutexGuard<'_, dyn BusDevice + 'static> {
    device
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(Vec<(u64, Vec<u8>)>);
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn routes_by_range_and_rejects_overlaps() {
        let mut bus = Bus::default();
        let a = Arc::new(Mutex::new(Echo(vec![])));
        bus.insert(0x3f8, 8, a.clone()).unwrap();
        bus.insert(0x60, 1, Arc::new(Mutex::new(Echo(vec![]))))
            .unwrap();
        assert!(bus.insert(0x3fc, 8, a.clone()).is_err());
        assert!(bus.insert(0x3f0, 9, a.clone()).is_err());
        assert!(bus.insert(u64::MAX, 2, a.clone()).is_err());
        let mut byte = [0u8; 1];
        assert!(bus.read(0x3fd, &mut byte));
        assert_eq!(byte[0], 5);
        assert!(bus.write(0x3f8, b"x"));
        assert!(!bus.read(0x3f7, &mut byte));
        assert!(!bus.read(0x400, &mut byte));
        // An access straddling the end of a window belongs to nobody.
        let mut word = [0u8; 4];
        assert!(!bus.read(0x3fe, &mut word));
        assert_eq!(a.lock().unwrap().0, vec![(0, vec![b'x'])]);
    }
}
