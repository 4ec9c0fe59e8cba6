//! The device thread: one epoll loop that serves every device's file descriptors (host
//! sockets, queue-notify eventfds) and timers, so no device needs a thread of its own.
//!
//! It can be paused: while paused no device code runs, so a paused VM's RAM and device state
//! stay still (what a snapshot needs).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// A device (or anything else) that owns descriptors in the loop.
pub trait Subscriber: Send {
    /// Adds the descriptors the subscriber starts with.
    fn register(&mut self, registry: &mut Registry<'_>) -> io::Result<()>;
    /// One readiness event for a descriptor registered under `token`.
    fn on_event(&mut self, token: u32, events: EventSet, registry: &mut Registry<'_>);
    /// The next instant at which `on_deadline` must run, if any.
    fn deadline(&self) -> Option<Instant> {
        None
    }
    fn on_deadline(&mut self, _now: Instant, _registry: &mut Registry<'_>) {}
}

/// A subscriber's view of the epoll set: tokens are scoped to the subscriber.
pub struct Registry<'a> {
    epoll: &'a Epoll,
    subscriber: u32,
}

impl<'a> Registry<'a> {
    /// A registry over an epoll set driven by someone else (device tests pump it by hand).
    pub fn new(epoll: &'a Epoll, subscriber: u32) -> Self {
        Self { epoll, subscriber }
    }

    fn data(&self, token: u32) -> u64 {
        (u64::from(self.subscriber) << 32) | u64::from(token)
    }

    pub fn add(&mut self, fd: RawFd, token: u32, events: EventSet) -> io::Result<()> {
        self.epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(events, self.data(token)),
        )
    }

    pub fn modify(&mut self, fd: RawFd, token: u32, events: EventSet) -> io::Result<()> {
        self.epoll.ctl(
            ControlOperation::Modify,
            fd,
            EpollEvent::new(events, self.data(token)),
        )
    }

    pub fn remove(&mut self, fd: RawFd) {
        // The fd may already be closed, which removed it from the set; nothing to undo then.
        let _ = self
            .epoll
            .ctl(ControlOperation::Delete, fd, EpollEvent::default());
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    Run,
    Pause,
    Stop,
}

struct Control {
    command: Mutex<(Command, bool)>,
    acked: Condvar,
    wake: EventFd,
}

impl Control {
    fn lock(&self) -> MutexGuard<'_, (Command, bool)> {
        self.command.lock().unwrap_or_else(|p| p.into_inner())
    }
}

const CONTROL_DATA: u64 = u64::MAX;

/// The running device thread.
pub struct EventLoop {
    control: Arc<Control>,
    epoll: Arc<Epoll>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug, thiserror::Error)]
pub enum EventLoopError {
    #[error("setting up the device event loop: {0}")]
    Setup(io::Error),
    #[error("the device thread did not {0} within {1:?}")]
    Timeout(&'static str, Duration),
}

impl EventLoop {
    pub fn start(mut subscribers: Vec<Box<dyn Subscriber>>) -> Result<Self, EventLoopError> {
        let epoll = Epoll::new().map_err(EventLoopError::Setup)?;
        let wake =
            EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(EventLoopError::Setup)?;
        epoll
            .ctl(
                ControlOperation::Add,
                wake.as_raw_fd(),
                EpollEvent::new(EventSet::IN, CONTROL_DATA),
            )
            .map_err(EventLoopError::Setup)?;
        for (index, subscriber) in subscribers.iter_mut().enumerate() {
            let mut registry = Registry {
                epoll: &epoll,
                subscriber: index as u32,
            };
            subscriber
                .register(&mut registry)
                .map_err(EventLoopError::Setup)?;
        }
        let control = Arc::new(Control {
            command: Mutex::new((Command::Run, true)),
            acked: Condvar::new(),
            wake,
        });
        let epoll = Arc::new(epoll);
        let thread_control = control.clone();
        let thread_epoll = epoll.clone();
        let thread = std::thread::Builder::new()
            .name("devices".into())
            .spawn(move || run(&thread_epoll, subscribers, &thread_control))
            .map_err(EventLoopError::Setup)?;
        Ok(Self {
            control,
            epoll,
            thread: Some(thread),
        })
    }

    /// Subscriber `index`'s view of the epoll set, for device work done from another thread
    /// while the loop is paused (a snapshot resetting vsock streams).
    pub fn registry(&self, index: u32) -> Registry<'_> {
        Registry::new(&self.epoll, index)
    }

    fn command(&self, command: Command, what: &'static str) -> Result<(), EventLoopError> {
        const TIMEOUT: Duration = Duration::from_secs(5);
        let mut state = self.control.lock();
        *state = (command, false);
        if let Err(e) = self.control.wake.write(1) {
            tracing::error!(error = %e, "could not wake the device thread");
        }
        let (state, timeout) = self
            .control
            .acked
            .wait_timeout_while(state, TIMEOUT, |(_, acked)| !*acked)
            .unwrap_or_else(|p| p.into_inner());
        if timeout.timed_out() && !state.1 {
            return Err(EventLoopError::Timeout(what, TIMEOUT));
        }
        Ok(())
    }

    /// Returns once no device code runs any more.
    pub fn pause(&self) -> Result<(), EventLoopError> {
        self.command(Command::Pause, "pause")
    }

    pub fn resume(&self) -> Result<(), EventLoopError> {
        self.command(Command::Run, "resume")
    }

    pub fn stop(&mut self) {
        if let Some(thread) = self.thread.take() {
            if let Err(e) = self.command(Command::Stop, "stop") {
                tracing::error!(error = %e, "device thread stop");
            }
            if thread.join().is_err() {
                tracing::error!("the device thread panicked");
            }
        }
    }
}

impl Drop for EventLoop {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(epoll: &Epoll, mut subscribers: Vec<Box<dyn Subscriber>>, control: &Control) {
    crate::seccomp::enter(crate::seccomp::Role::Devices);
    let mut events = vec![EpollEvent::default(); 64];
    let mut paused = false;
    loop {
        let timeout = if paused {
            -1
        } else {
            next_timeout(&subscribers)
        };
        let count = match epoll.wait(timeout, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!(error = %e, "epoll_wait on the device thread failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        for event in &events[..count] {
            if event.data() == CONTROL_DATA {
                let _ = control.wake.read();
                let mut state = control.lock();
                match state.0 {
                    Command::Stop => {
                        state.1 = true;
                        control.acked.notify_all();
                        return;
                    }
                    Command::Pause => paused = true,
                    Command::Run => paused = false,
                }
                state.1 = true;
                control.acked.notify_all();
                continue;
            }
            if paused {
                // Level-triggered: the event comes back once we resume.
                continue;
            }
            let index = (event.data() >> 32) as u32;
            if let Some(subscriber) = subscribers.get_mut(index as usize) {
                let mut registry = Registry {
                    epoll,
                    subscriber: index,
                };
                subscriber.on_event(event.data() as u32, event.event_set(), &mut registry);
            }
        }
        if paused {
            // Device descriptors stay registered but ignored; block on the control eventfd
            // alone so level-triggered readiness cannot keep the thread busy.
            wait_for_command(control);
            continue;
        }
        let now = Instant::now();
        for (index, subscriber) in subscribers.iter_mut().enumerate() {
            if subscriber.deadline().is_some_and(|d| d <= now) {
                let mut registry = Registry {
                    epoll,
                    subscriber: index as u32,
                };
                subscriber.on_deadline(now, &mut registry);
            }
        }
    }
}

fn wait_for_command(control: &Control) {
    let mut pollfd = libc::pollfd {
        fd: control.wake.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd, count 1, no timeout; poll does not retain the pointer.
        let rc = unsafe { libc::poll(&mut pollfd, 1, -1) };
        if rc >= 0 {
            return;
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return;
        }
    }
}

fn next_timeout(subscribers: &[Box<dyn Subscriber>]) -> i32 {
    let now = Instant::now();
    subscribers
        .iter()
        .filter_map(|s| s.deadline())
        .min()
        .map(|deadline| {
            let wait = deadline.saturating_duration_since(now);
            // Round up so we never wake just before the deadline and spin.
            wait.as_millis().min(i32::MAX as u128) as i32
                + i32::from(wait.subsec_nanos() % 1_000_000 != 0)
        })
        .unwrap_or(-1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Counter {
        fd: EventFd,
        seen: Arc<AtomicUsize>,
    }

    impl Subscriber for Counter {
        fn register(&mut self, registry: &mut Registry<'_>) -> io::Result<()> {
            registry.add(self.fd.as_raw_fd(), 7, EventSet::IN)
        }
        fn on_event(&mut self, token: u32, _: EventSet, _: &mut Registry<'_>) {
            assert_eq!(token, 7);
            let _ = self.fd.read();
            self.seen.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn wait_for(seen: &AtomicUsize, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while seen.load(Ordering::SeqCst) < n {
            assert!(Instant::now() < deadline, "event not delivered");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn delivers_events_and_holds_them_while_paused() {
        let fd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let trigger = fd.try_clone().unwrap();
        let seen = Arc::new(AtomicUsize::new(0));
        let mut event_loop = EventLoop::start(vec![Box::new(Counter {
            fd,
            seen: seen.clone(),
        })])
        .unwrap();
        trigger.write(1).unwrap();
        wait_for(&seen, 1);
        event_loop.pause().unwrap();
        trigger.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(seen.load(Ordering::SeqCst), 1, "ran while paused");
        event_loop.resume().unwrap();
        wait_for(&seen, 2);
        event_loop.stop();
    }
}
