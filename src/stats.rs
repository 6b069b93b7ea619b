//! Counters an operator reads in `INFO qag`: every command's calls and error replies,
//! and what the deciding commands decided, counted since the module loaded.

use std::ffi::{c_int, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use redis_module::raw;

/// The crate's version, `Cargo.toml`'s, as INFO shows it.
pub const VERSION: &CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(version) => version,
        Err(_) => panic!("the crate version holds a NUL"),
    };

/// The most outcomes one command counts (TAKE2: allowed, refused by either bucket).
const MAX_OUTCOMES: usize = 3;

/// One command's counters. Relaxed atomics: they are only ever written on the server's
/// main thread, and INFO reads them there too.
pub struct CallCounters {
    calls: AtomicU64,
    errors: AtomicU64,
    outcomes: [AtomicU64; MAX_OUTCOMES],
}

impl CallCounters {
    pub const fn new() -> CallCounters {
        CallCounters {
            calls: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            outcomes: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    pub fn called(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    pub fn erred(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts `ALLOWED` or `REFUSED`.
    pub fn allowed_or_refused(&self, allowed: bool) {
        self.decided(if allowed { ALLOWED } else { REFUSED });
    }

    /// Counts outcome number `outcome`, an index into the command's `OUTCOMES`.
    pub fn decided(&self, outcome: usize) {
        if let Some(counter) = self.outcomes.get(outcome) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn reset(&self) {
        for counter in [&self.calls, &self.errors]
            .into_iter()
            .chain(&self.outcomes)
        {
            counter.store(0, Ordering::Relaxed);
        }
    }
}

/// Outcome indices shared by the commands that allow or refuse.
pub const ALLOWED: usize = 0;
pub const REFUSED: usize = 1;
/// TAKE2's third outcome: the client bucket allowed, the key bucket refused.
pub const REFUSED_KEY: usize = 2;

/// A registered command's counters and the INFO field names they are shown under.
struct Shown {
    counters: &'static CallCounters,
    calls: CString,
    errors: CString,
    outcomes: Vec<CString>,
}

static REGISTERED: Mutex<Vec<Shown>> = Mutex::new(Vec::new());

/// What calls with `WAIT ms` did, since the module loaded (INFO's `wait_*` fields;
/// `waiters`, the clients held now, is wait.rs's). Main thread only, as every counter
/// here.
pub struct WaitCounters {
    started: AtomicU64,
    served: AtomicU64,
    refused: AtomicU64,
    timed_out: AtomicU64,
    given_back: AtomicU64,
    dropped: AtomicU64,
    moved: AtomicU64,
    full: AtomicU64,
    waited_ms: AtomicU64,
}

pub static WAITS: WaitCounters = WaitCounters {
    started: AtomicU64::new(0),
    served: AtomicU64::new(0),
    refused: AtomicU64::new(0),
    timed_out: AtomicU64::new(0),
    given_back: AtomicU64::new(0),
    dropped: AtomicU64::new(0),
    moved: AtomicU64::new(0),
    full: AtomicU64::new(0),
    waited_ms: AtomicU64::new(0),
};

impl WaitCounters {
    /// A call began to wait.
    pub fn started(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
    }

    /// A wait was served after `waited_ms`.
    pub fn served(&self, waited_ms: i64) {
        self.served.fetch_add(1, Ordering::Relaxed);
        self.waited_ms
            .fetch_add(waited_ms.max(0) as u64, Ordering::Relaxed);
    }

    /// A wait ran out: refused.
    pub fn timed_out(&self) {
        self.timed_out.fetch_add(1, Ordering::Relaxed);
    }

    /// A waiter was never answered allowed (its client gone or unblocked while it
    /// waited, or its answer never written): what it was charged or given goes back.
    pub fn given_back(&self) {
        self.given_back.fetch_add(1, Ordering::Relaxed);
    }

    /// Give-backs a primary turned replica dropped: the new primary has the charges.
    pub fn dropped(&self, count: u64) {
        self.dropped.fetch_add(count, Ordering::Relaxed);
    }

    /// A slot waiter told to try again: its key's slot moved to another node.
    pub fn moved(&self) {
        self.moved.fetch_add(1, Ordering::Relaxed);
    }

    /// A call asked to wait longer than it may: refused at once.
    pub fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// A call could not wait: MAX-WAITERS were waiting.
    pub fn full(&self) {
        self.full.fetch_add(1, Ordering::Relaxed);
    }

    fn fields(&self) -> [(&'static CStr, u64); 9] {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        [
            (c"wait_started", read(&self.started)),
            (c"wait_served", read(&self.served)),
            (c"wait_refused", read(&self.refused)),
            (c"wait_timed_out", read(&self.timed_out)),
            (c"wait_given_back", read(&self.given_back)),
            (c"wait_given_back_dropped", read(&self.dropped)),
            (c"wait_moved", read(&self.moved)),
            (c"wait_full", read(&self.full)),
            (c"wait_ms", read(&self.waited_ms)),
        ]
    }

    fn reset(&self) {
        for counter in [
            &self.started,
            &self.served,
            &self.refused,
            &self.timed_out,
            &self.given_back,
            &self.dropped,
            &self.moved,
            &self.full,
            &self.waited_ms,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
    }
}

/// Calls of any command answered with the reply remembered under their request id.
static REPLAYS: AtomicU64 = AtomicU64::new(0);

/// Counts a call answered from its request id's remembered reply.
pub fn replayed() {
    REPLAYS.fetch_add(1, Ordering::Relaxed);
}

/// Forgets the commands of an earlier load, so a module loaded again starts from zero.
pub fn clear() {
    lock().clear();
    REPLAYS.store(0, Ordering::Relaxed);
    WAITS.reset();
}

/// Shows `counters`, from zero, under the command's name after `qag.` with dots as
/// underscores: `take2_calls`, `quota_add_errors`, `take_allowed`; the server prefixes
/// every field with the module's name, `qag_`.
pub fn show(name: &CStr, counters: &'static CallCounters, outcomes: &[&str]) -> Result<(), String> {
    let name = name.to_string_lossy();
    let short = name.strip_prefix("qag.").unwrap_or(&name).replace('.', "_");
    let field = |suffix: &str| {
        CString::new(format!("{short}_{suffix}")).map_err(|e| format!("INFO field {e}"))
    };
    if outcomes.len() > MAX_OUTCOMES {
        return Err(format!("{name} counts more than {MAX_OUTCOMES} outcomes"));
    }
    counters.reset();
    let shown = Shown {
        counters,
        calls: field("calls")?,
        errors: field("errors")?,
        outcomes: outcomes
            .iter()
            .map(|o| field(o))
            .collect::<Result<_, _>>()?,
    };
    lock().push(shown);
    Ok(())
}

fn lock() -> std::sync::MutexGuard<'static, Vec<Shown>> {
    // A panic while the list was held cannot leave it half-written: keep using it.
    REGISTERED.lock().unwrap_or_else(|e| e.into_inner())
}

/// The INFO callback: one section, `# qag`, of flat fields.
pub extern "C" fn info(ctx: *mut raw::RedisModuleInfoCtx, _for_crash_report: c_int) {
    // A panic must not unwind into the server; a section cut short is all it costs.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: entries checked at load; a live info context; C strings that outlive
        // the calls (the server copies them).
        unsafe {
            raw::RedisModule_InfoAddSection.unwrap()(ctx, c"".as_ptr());
            let add = raw::RedisModule_InfoAddFieldCString.unwrap();
            add(ctx, c"version".as_ptr(), VERSION.as_ptr());
            add(ctx, c"clock".as_ptr(), crate::server::clock_name().as_ptr());
            let add = raw::RedisModule_InfoAddFieldULongLong.unwrap();
            add(ctx, c"replays".as_ptr(), REPLAYS.load(Ordering::Relaxed));
            if let Some(blocked) = crate::wait::blocked() {
                add(ctx, c"waiters".as_ptr(), blocked);
            }
            for (name, value) in WAITS.fields() {
                add(ctx, name.as_ptr(), value);
            }
            for shown in lock().iter() {
                let c = shown.counters;
                add(ctx, shown.calls.as_ptr(), c.calls.load(Ordering::Relaxed));
                add(ctx, shown.errors.as_ptr(), c.errors.load(Ordering::Relaxed));
                for (name, counter) in shown.outcomes.iter().zip(&c.outcomes) {
                    add(ctx, name.as_ptr(), counter.load(Ordering::Relaxed));
                }
            }
        }
    });
}
