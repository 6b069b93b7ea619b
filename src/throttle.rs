//! QAG.THROTTLE, redis-cell's CL.THROTTLE on redis-cell's own keys (a string holding
//! the theoretical arrival time in nanoseconds), and CL.THROTTLE itself when the module
//! is loaded with `CL-THROTTLE`. With `WAIT ms`, a call that would conform within `ms`
//! is charged when it arrives and answered when it conforms (wait.rs holds it).

use std::ffi::CStr;
use std::sync::atomic::{AtomicI64, Ordering};

use qag_core::args::ArgList;
use qag_core::number::{format_integer, NumberBuffer};
use qag_core::throttle::{self, Throttle as Outcome, ThrottleArgs, ThrottleWaiting};

use crate::command::{Arg, Command, KeyLayout, RawArgs, Reply, Row, WAIT_ARG};
use crate::key::{Access, Key, OwnedString, ValueType};
use crate::server::{CommandError, Ctx, RawString};
use crate::stats::{CallCounters, WAITS};
use crate::wait::{self, Held, Serve};

/// THROTTLE-SKEW, in seconds: set once when the module loads.
static SKEW_SECONDS: AtomicI64 = AtomicI64::new(qag_core::load::DEFAULT_THROTTLE_SKEW_SECONDS);

/// Sets how far beyond its burst window a stored TAT is trusted; called at load.
pub fn set_skew_seconds(seconds: i64) {
    SKEW_SECONDS.store(seconds, Ordering::Relaxed);
}

static THROTTLE: CallCounters = CallCounters::new();
static CL_THROTTLE: CallCounters = CallCounters::new();

const THROTTLE_ARGS: &[Arg] = &[
    Arg::key(c"key", 0),
    Arg::integer(c"max_burst"),
    Arg::integer(c"count"),
    Arg::integer(c"period"),
    Arg::integer(c"quantity").optional(),
    WAIT_ARG,
];
const THROTTLE_SUMMARY: &CStr = c"GCRA rate limiting on redis-cell's keys; replies [limited, limit, remaining, retry after, reset after]";
const THROTTLE_OUTCOMES: &[&str] = &["allowed", "refused"];

/// A throttle's key, opened.
struct Tat<'ctx> {
    key: Key<'ctx>,
}

impl<'ctx> Tat<'ctx> {
    fn open(ctx: &'ctx Ctx, name: RawString, access: Access) -> Result<Self, CommandError> {
        Ok(Tat {
            key: Key::open(ctx, name, access, ValueType::String)?,
        })
    }

    /// The stored TAT; an error for a value that is none.
    fn stored(&self) -> Result<Option<u64>, CommandError> {
        match self.key.string_value() {
            None => Ok(None),
            Some(value) => Ok(Some(throttle::parse_tat(value).ok_or(CommandError::Refused(
                "ERR the key does not hold a throttle's time (a non-negative integer of nanoseconds); nothing was written",
            ))?)),
        }
    }

    fn write(&mut self, tat: u64) {
        // Its decimal digits, as redis-cell writes it: a string, rewritten in place on
        // an existing key, never an integer-encoded value a read would have to re-make.
        let mut digits = NumberBuffer::new();
        let value = format_integer(&mut digits, tat).as_bytes();
        self.key
            .set_string_expiring_at(value, throttle::expire_at_millis(tat));
    }
}

fn skew() -> i128 {
    throttle::skew_nanos(SKEW_SECONDS.load(Ordering::Relaxed))
}

/// One throttle call, counted in `counters`.
fn throttle_call(
    ctx: &Ctx,
    args: &RawArgs,
    counters: &CallCounters,
) -> Result<Reply, CommandError> {
    let call: ThrottleArgs = throttle::parse_throttle(args)?;
    // A peek (quantity 0) only reads.
    let access = match call.quantity {
        0 => Access::Read,
        _ => Access::ReadWrite,
    };
    let mut tat = Tat::open(ctx, args.string(call.key), access)?;
    let stored = tat.stored()?;
    let now_micros = ctx.now_micros();
    let now = now_micros.saturating_mul(1000);
    let refused = |e: throttle::ThrottleError| CommandError::Refused(e.message());
    let Some(wait_ms) = call.wait else {
        let outcome = throttle::throttle(&call, stored, now, skew()).map_err(refused)?;
        if let Some(at) = outcome.write {
            tat.write(at);
        }
        counters.allowed_or_refused(!outcome.limited);
        return Ok(Reply::Array(outcome.as_reply().into()));
    };
    let waiting =
        throttle::throttle_waiting(&call, stored, now, skew(), wait_ms).map_err(refused)?;
    // Room is asked only of a call that must wait.
    let later = match waiting {
        ThrottleWaiting::Later { served, wait_nanos } => {
            wait::room(ctx).ok().map(|()| (served, wait_nanos))
        }
        ThrottleWaiting::Now(_) => None,
    };
    let (served, wait_nanos) = match later {
        Some(later) => later,
        // Answered now, as without WAIT: a sixth element, nothing waited.
        None => {
            let outcome = throttle::throttle(&call, stored, now, skew()).map_err(refused)?;
            if let Some(at) = outcome.write {
                tat.write(at);
            }
            if matches!(waiting, ThrottleWaiting::Now(_))
                && outcome.limited
                && outcome.retry_after_nanos >= 0
            {
                WAITS.refused();
            }
            counters.allowed_or_refused(!outcome.limited);
            return Ok(Reply::Array(waited_row(&outcome, 0)));
        }
    };
    if let Some(at) = served.write {
        tat.write(at);
    }
    counters.allowed_or_refused(true);
    let due = now_micros + (wait_nanos + 999) / 1000;
    let held = HeldThrottle {
        keys: vec![args.get(call.key).to_vec()],
        call,
        served,
        due,
    };
    Ok(wait::hold(ctx, Box::new(held), due, true, None))
}

/// A throttle's reply with how long the call waited, the reply of a call with WAIT.
fn waited_row(outcome: &Outcome, waited_ms: i64) -> Row {
    let [limited, limit, remaining, retry, reset] = outcome.as_reply();
    Row::from([limited, limit, remaining, retry, reset, waited_ms])
}

/// A throttle charged when it arrived, answered when it conforms.
struct HeldThrottle {
    keys: Vec<Vec<u8>>,
    call: ThrottleArgs,
    served: Outcome,
    /// When it conforms, Unix microseconds.
    due: i64,
}

impl Held for HeldThrottle {
    fn keys(&self) -> &[Vec<u8>] {
        &self.keys
    }

    fn serve(&mut self, _ctx: &Ctx, _now_micros: i64, waited_ms: i64) -> Serve {
        Serve::Now(Reply::Array(waited_row(&self.served, waited_ms)))
    }

    fn refusal(&self, _ctx: &Ctx, now_micros: i64, waited_ms: i64) -> Reply {
        let left = i128::from((self.due - now_micros).max(0)) * 1000;
        let refused = Outcome {
            limited: true,
            remaining: 0,
            retry_after_nanos: left,
            reset_after_nanos: left,
            write: None,
            ..self.served
        };
        Reply::Array(waited_row(&refused, waited_ms))
    }

    fn give_back(&mut self, ctx: &Ctx, now_micros: i64) -> Vec<(usize, f64)> {
        let name = OwnedString::new(ctx, &self.keys[0]);
        let Ok(mut tat) = Tat::open(ctx, name.raw, Access::ReadWrite) else {
            return Vec::new();
        };
        let Ok(stored) = tat.stored() else {
            return Vec::new();
        };
        let now = now_micros.saturating_mul(1000);
        match throttle::give_back(&self.call, stored, now, skew()) {
            Ok((back, sooner)) => {
                if let Some(at) = back {
                    tat.write(at);
                }
                vec![(0, sooner as f64)]
            }
            Err(_) => Vec::new(),
        }
    }

    fn sooner(&mut self, _key: usize, nanos: f64) -> Option<i64> {
        self.due -= (nanos / 1000.0).floor() as i64;
        Some(self.due)
    }
}

/// QAG.THROTTLE key max_burst count period [quantity]; with `REDIS_CELL_NAME`, the
/// same command as CL.THROTTLE, so that redis-cell's clients need no change (registered
/// only when asked for).
pub struct Throttle<const REDIS_CELL_NAME: bool>;

impl<const REDIS_CELL_NAME: bool> Command for Throttle<REDIS_CELL_NAME> {
    const NAME: &'static CStr = match REDIS_CELL_NAME {
        true => c"cl.throttle",
        false => c"qag.throttle",
    };
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = -5;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = true;
    const SUMMARY: &'static CStr = THROTTLE_SUMMARY;
    const COMPLEXITY: &'static CStr = c"O(1)";
    const ARGS: &'static [Arg] = THROTTLE_ARGS;
    const SINCE: &'static CStr = c"0.2.0";
    const COUNTERS: &'static CallCounters = match REDIS_CELL_NAME {
        true => &CL_THROTTLE,
        false => &THROTTLE,
    };
    const OUTCOMES: &'static [&'static str] = THROTTLE_OUTCOMES;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        throttle_call(ctx, args, Self::COUNTERS)
    }
}
