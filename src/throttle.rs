//! QAG.THROTTLE, redis-cell's CL.THROTTLE on redis-cell's own keys (a string holding
//! the theoretical arrival time in nanoseconds), and CL.THROTTLE itself when the module
//! is loaded with `CL-THROTTLE`.

use std::ffi::CStr;
use std::sync::atomic::{AtomicI64, Ordering};

use qag_core::number::{format_integer, NumberBuffer};
use qag_core::throttle::{self, ThrottleArgs};

use crate::command::{Arg, Command, KeyLayout, RawArgs, Reply};
use crate::key::{Access, Key, ValueType};
use crate::server::{CommandError, Ctx};
use crate::stats::CallCounters;

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
];
const THROTTLE_SUMMARY: &CStr = c"GCRA rate limiting on redis-cell's keys; replies [limited, limit, remaining, retry after, reset after]";
const THROTTLE_OUTCOMES: &[&str] = &["allowed", "refused"];

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
    let mut key = Key::open(ctx, args.string(call.key), access, ValueType::String)?;
    let stored = match key.string_value() {
        None => None,
        Some(value) => Some(throttle::parse_tat(value).ok_or(CommandError::Refused(
            "ERR the key does not hold a throttle's time (a non-negative integer of nanoseconds); nothing was written",
        ))?),
    };
    let now = ctx.now_micros().saturating_mul(1000);
    let skew = throttle::skew_nanos(SKEW_SECONDS.load(Ordering::Relaxed));
    let outcome = throttle::throttle(&call, stored, now, skew)
        .map_err(|e| CommandError::Refused(e.message()))?;
    if let Some(tat) = outcome.write {
        // Its decimal digits, as redis-cell writes it: a string, rewritten in place on
        // an existing key, never an integer-encoded value a read would have to re-make.
        let mut digits = NumberBuffer::new();
        let value = format_integer(&mut digits, tat).as_bytes();
        key.set_string_expiring_at(value, throttle::expire_at_millis(tat));
    }
    counters.allowed_or_refused(!outcome.limited);
    Ok(Reply::Array(outcome.as_reply().into()))
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
