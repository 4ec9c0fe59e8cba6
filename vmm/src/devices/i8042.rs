//! Just enough of the PS/2 controller for a guest to reboot through it (`reboot=k`): the
//! 0xFE command pulses the CPU reset line, which ends the VM.

use std::sync::Arc;

use super::bus::BusDevice;
use crate::exit::{ExitReason, ExitSignal};

/// Offsets within the window that starts at the data port (0x60).
#[cfg(test)]
const DATA: u64 = 0;
const COMMAND: u64 = 4;
pub const WINDOW_LEN: u64 = 5;
const CMD_RESET_CPU: u8 = 0xfe;

pub struct I8042 {
    exit: Arc<ExitSignal>,
}

impl I8042 {
    pub fn new(exit: Arc<ExitSignal>) -> Self {
        Self { exit }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Data and status both read 0: no byte waiting and the input buffer empty, so a
        // driver polling the status never waits on us.
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == COMMAND && data.first() == Some(&CMD_RESET_CPU) {
            self.exit.request(ExitReason::GuestReset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_requests_exit_and_nothing_else_does() {
        let exit = Arc::new(ExitSignal::new().unwrap());
        let mut dev = I8042::new(exit.clone());
        dev.write(DATA, &[CMD_RESET_CPU]);
        dev.write(COMMAND, &[0xd1]);
        let mut status = [0xffu8];
        dev.read(COMMAND, &mut status);
        assert_eq!(status[0], 0);
        assert!(!exit.requested());
        dev.write(COMMAND, &[CMD_RESET_CPU]);
        assert_eq!(exit.reason(), Some(ExitReason::GuestReset));
    }
}
