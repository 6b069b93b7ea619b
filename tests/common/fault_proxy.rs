//! A TCP proxy of the tests' own between a client and a server, on a loopback port of
//! its own (so the server behind it can be restarted on its port), that does to the
//! traffic what a network and a failing server do, when told: replies delayed, a reply
//! swallowed after the command ran (the connection closed instead), every connection
//! reset, new connections refused. Threads, no runtime: the module's tests use it too.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

#[derive(Default)]
struct Faults {
    /// Each reply held this long before it is passed on.
    delay_ms: AtomicU64,
    /// Replies still to swallow (each closes its connection: the client never learns
    /// whether its command ran).
    swallow: AtomicU32,
    /// New connections closed at once.
    refuse: AtomicBool,
    stopping: AtomicBool,
    /// Both ends of every connection, to reset them.
    open: Mutex<Vec<TcpStream>>,
    swallowed: AtomicU64,
}

pub struct FaultProxy {
    pub port: u16,
    faults: Arc<Faults>,
    accepting: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// A proxy to the server on `target` (127.0.0.1).
    pub fn start(target: u16) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port for the proxy");
        let port = listener.local_addr().expect("its address").port();
        let faults = Arc::new(Faults::default());
        let shared = faults.clone();
        let accepting = std::thread::spawn(move || {
            for client in listener.incoming() {
                if shared.stopping.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                if shared.refuse.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                relay(&shared, client, server);
            }
        });
        FaultProxy {
            port,
            faults,
            accepting: Some(accepting),
        }
    }

    pub fn delay(&self, delay: Duration) {
        self.faults
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// The next `replies` replies (of any connection) are swallowed, each connection
    /// that had one closed.
    pub fn swallow(&self, replies: u32) {
        self.faults.swallow.store(replies, Ordering::SeqCst);
    }

    /// How many replies were swallowed so far.
    pub fn swallowed(&self) -> u64 {
        self.faults.swallowed.load(Ordering::SeqCst)
    }

    /// Every open connection reset.
    pub fn reset_all(&self) {
        for stream in lock(&self.faults.open).drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// New connections closed at once (and, when `on`, the open ones reset).
    pub fn refuse(&self, on: bool) {
        self.faults.refuse.store(on, Ordering::SeqCst);
        if on {
            self.reset_all();
        }
    }

    /// No fault from now on.
    pub fn heal(&self) {
        self.delay(Duration::ZERO);
        self.swallow(0);
        self.faults.refuse.store(false, Ordering::SeqCst);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.faults.stopping.store(true, Ordering::SeqCst);
        self.reset_all();
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(accepting) = self.accepting.take() {
            let _ = accepting.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Copies each way in a thread of its own, the faults on the replies' way.
fn relay(faults: &Arc<Faults>, client: TcpStream, server: TcpStream) {
    let (Ok(client_out), Ok(server_in), Ok(client_kept), Ok(server_kept)) = (
        client.try_clone(),
        server.try_clone(),
        client.try_clone(),
        server.try_clone(),
    ) else {
        return;
    };
    {
        let mut open = lock(&faults.open);
        open.retain(|stream| stream.peer_addr().is_ok());
        open.extend([client_kept, server_kept]);
    }
    std::thread::spawn(move || copy(client, server_in, None));
    let faults = faults.clone();
    std::thread::spawn(move || copy(server, client_out, Some(&faults)));
}

/// Copies `from` to `to` until either closes; with `faults`, each chunk (a reply, or a
/// few) delayed or swallowed as they say.
fn copy(mut from: TcpStream, mut to: TcpStream, faults: Option<&Faults>) {
    let mut buffer = [0u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if let Some(faults) = faults {
            let delay = faults.delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                std::thread::sleep(Duration::from_millis(delay));
            }
            let swallow = faults
                .swallow
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            if swallow.is_ok() {
                faults.swallowed.fetch_add(1, Ordering::SeqCst);
                break;
            }
        }
        if to.write_all(&buffer[..read]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
