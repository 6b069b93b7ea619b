//! GCRA rate limiting as redis-cell's `CL.THROTTLE` computes it (0.5.0,
//! `src/cell/mod.rs` and the reply in `src/lib.rs`), on the same state: one integer, the
//! theoretical arrival time (TAT) in nanoseconds since the Unix epoch.
//!
//! redis-cell keeps times as `time` 0.3's `OffsetDateTime` and `Duration` (whole seconds
//! and nanoseconds, 96 bits), reads the stored TAT as a `u64` and takes any `i64` of
//! seconds as a period; this computes the same values exactly in `i128` nanoseconds.
//! Where redis-cell would overflow, wrap or divide by zero (and abort the server or
//! store garbage), this refuses with an error instead.

use crate::args::{ArgError, ArgList, Args};
use crate::wait::{self, MAX_WAIT_MS};

const NANOS_PER_SECOND: i128 = 1_000_000_000;

/// `key max_burst count period [quantity] [WAIT ms]`: `count` per `period` seconds,
/// bursts of `max_burst + 1`, taking `quantity` (0: only look), waiting up to `ms` for
/// it when given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThrottleArgs {
    pub key: usize,
    pub max_burst: i64,
    pub count: i64,
    pub period: i64,
    pub quantity: i64,
    pub wait: Option<i64>,
}

pub fn parse_throttle<L: ArgList + ?Sized>(list: &L) -> Result<ThrottleArgs, ArgError> {
    let mut args = Args::new(list);
    // Room for WAIT twice, so that is refused as such.
    args.expect_count(4, 9)?;
    let key = args.key()?;
    let max_burst = args.integer("max_burst", 0, i64::MAX - 1)?;
    let count = args.integer("count", 1, i64::MAX)?;
    let period = args.integer("period", 1, i64::MAX)?;
    let quantity = match args.ahead(0) {
        Some(word) if !word.eq_ignore_ascii_case(b"WAIT") => {
            args.integer("quantity", 0, i64::MAX)?
        }
        _ => 1,
    };
    let mut wait = None;
    while args.option(&["WAIT"], "WAIT ms")?.is_some() {
        wait::parse_wait(&mut args, &mut wait)?;
    }
    Ok(ThrottleArgs {
        key,
        max_burst,
        count,
        period,
        quantity,
        wait,
    })
}

/// Why a throttle cannot be computed; nothing is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThrottleError {
    /// More than one per nanosecond: the emission interval would be 0.
    ZeroInterval,
    /// A burst or quantity whose nanoseconds overflow an i64 (redis-cell's product
    /// wraps), or a TAT to write beyond the u64 range redis-cell reads.
    Overflow,
}

impl ThrottleError {
    pub fn message(self) -> &'static str {
        match self {
            ThrottleError::ZeroInterval => {
                "ERR count per period is faster than one per nanosecond; nothing was written"
            }
            ThrottleError::Overflow => {
                "ERR the rate, burst or quantity overflows the nanosecond arithmetic; nothing was written"
            }
        }
    }
}

/// One call's result: the reply and, when the call takes something, the TAT to store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Throttle {
    pub limited: bool,
    /// max_burst + 1.
    pub limit: i64,
    pub remaining: i64,
    /// Nanoseconds until the call would be allowed; -1 s when allowed, and when it can
    /// never fit (its increment is more than the whole burst).
    pub retry_after_nanos: i128,
    /// Nanoseconds until the limiter is back to its full burst: TAT − now.
    pub reset_after_nanos: i128,
    /// The new TAT, written when allowed with a quantity above 0.
    pub write: Option<u64>,
}

impl Throttle {
    /// The five integers CL.THROTTLE answers, durations in whole seconds.
    pub fn as_reply(&self) -> [i64; 5] {
        [
            i64::from(self.limited),
            self.limit,
            self.remaining,
            reply_seconds(self.retry_after_nanos),
            reply_seconds(self.reset_after_nanos),
        ]
    }
}

/// A duration as redis-cell 0.5.0 replies it: `as_seconds_f64() as i64` (whole seconds
/// plus the nanoseconds as a fraction, in a double, which rounds to the nearest second
/// when the fraction is within half a unit of the last place of it, from about 2^24 s
/// on), plus one when the part below a second holds at least a whole millisecond (so a
/// caller never retries too early). Both parts take the duration's sign, so a negative
/// duration is truncated only.
pub fn reply_seconds(nanos: i128) -> i64 {
    // The same arithmetic in i64 where the duration fits, as every real one does: an
    // i128 division is a call into the compiler's runtime.
    let Ok(nanos) = i64::try_from(nanos) else {
        return reply_seconds_wide(nanos);
    };
    const NANOS: i64 = NANOS_PER_SECOND as i64;
    let (seconds, below) = (nanos / NANOS, nanos % NANOS);
    let as_f64 = seconds as f64 + below as f64 / NANOS as f64;
    as_f64 as i64 + i64::from(below / 1_000_000 > 0)
}

/// `reply_seconds` in i128, for any duration.
fn reply_seconds_wide(nanos: i128) -> i64 {
    let seconds = nanos / NANOS_PER_SECOND;
    let below = nanos % NANOS_PER_SECOND;
    let as_f64 = seconds as f64 + below as f64 / NANOS_PER_SECOND as f64;
    as_f64 as i64 + i64::from(below / 1_000_000 > 0)
}

/// The emission interval in nanoseconds: the period's nanoseconds (exact, any i64 of
/// seconds) divided by the count as doubles and truncated, saturating at the i64 range,
/// as redis-cell's `Rate::per_period` computes it.
pub fn emission_interval(count: i64, period: i64) -> Result<i64, ThrottleError> {
    let period_nanos = i128::from(period) * NANOS_PER_SECOND;
    let interval = (period_nanos as f64 / count as f64) as i64;
    match interval {
        0 => Err(ThrottleError::ZeroInterval),
        _ => Ok(interval),
    }
}

/// Throttles at `now` (nanoseconds since the Unix epoch) a limiter whose stored TAT is
/// `stored` (None when the key is missing).
///
/// One call's arithmetic before its decision.
struct Gcra {
    interval: i128,
    limit: i64,
    tolerance: i128,
    increment: i128,
    /// The stored TAT as trusted (now for none).
    tat: i128,
    /// The TAT once this call is taken.
    new_tat: i128,
    now: i128,
}

impl Gcra {
    /// A stored TAT is trusted up to `skew` nanoseconds, and the longest wait, beyond
    /// the limiter's own reach, `now + tolerance` (no call of this limiter writes a later
    /// one by this clock, but waiters, who may charge it up to the longest wait ahead):
    /// a TAT ahead by that little, as after a failover to a primary whose clock is
    /// behind, is kept, so the step back mints no credit. A later one (a clock stepped
    /// far forward, a stray write) is read as a missing key, so it never locks the
    /// limiter longer than its burst window, the skew and a longest wait. redis-cell
    /// trusts every TAT; a skew past the u64 range (e.g. `skew_nanos(i64::MAX)`) does
    /// the same.
    fn new(
        args: &ThrottleArgs,
        stored: Option<u64>,
        now: i64,
        skew: i128,
    ) -> Result<Gcra, ThrottleError> {
        let overflow = ThrottleError::Overflow;
        let interval = emission_interval(args.count, args.period)?;
        let limit = args.max_burst + 1;
        // Products of i64s in redis-cell (where they wrap): refused here.
        let tolerance = i128::from(interval.checked_mul(limit).ok_or(overflow)?);
        let increment = i128::from(interval.checked_mul(args.quantity).ok_or(overflow)?);
        let now = i128::from(now);
        let reach = tolerance + skew.saturating_add(i128::from(MAX_WAIT_MS) * 1_000_000);
        let tat = match stored.map(i128::from) {
            Some(tat) if tat - now <= reach => tat,
            _ => now,
        };
        Ok(Gcra {
            interval: i128::from(interval),
            limit,
            tolerance,
            increment,
            tat,
            new_tat: now.max(tat) + increment,
            now,
        })
    }

    /// When the call fits: its TAT less the burst window.
    fn allow_at(&self) -> i128 {
        self.new_tat - self.tolerance
    }

    /// The call taken at `at` (now, or when a waiter is served): the reply, and the TAT
    /// to write for a quantity above 0.
    fn taken(&self, at: i128, quantity: i64) -> Result<Throttle, ThrottleError> {
        let write = match quantity {
            0 => None,
            // redis-cell would wrap it (and store garbage): refused here.
            _ => Some(u64::try_from(self.new_tat).map_err(|_| ThrottleError::Overflow)?),
        };
        Ok(self.reply(false, -NANOS_PER_SECOND, self.new_tat - at, write))
    }

    fn reply(&self, limited: bool, retry: i128, ttl: i128, write: Option<u64>) -> Throttle {
        let next = self.tolerance - ttl;
        // redis-cell divides whole microseconds as doubles; an interval under a
        // microsecond makes that an infinite or undefined quotient, which the cast
        // saturates.
        let remaining = match next > -self.interval {
            true => (whole_micros(next) / whole_micros(self.interval)) as i64,
            false => 0,
        };
        Throttle {
            limited,
            limit: self.limit,
            remaining,
            retry_after_nanos: retry,
            reset_after_nanos: ttl,
            write,
        }
    }
}

/// Throttles at `now` (nanoseconds since the Unix epoch) a limiter whose stored TAT is
/// `stored` (None when the key is missing); how far ahead a stored TAT is trusted:
/// `Gcra::new`.
pub fn throttle(
    args: &ThrottleArgs,
    stored: Option<u64>,
    now: i64,
    skew: i128,
) -> Result<Throttle, ThrottleError> {
    let gcra = Gcra::new(args, stored, now, skew)?;
    refused_or_taken(&gcra, args)
}

fn refused_or_taken(gcra: &Gcra, args: &ThrottleArgs) -> Result<Throttle, ThrottleError> {
    let allow_at = gcra.allow_at();
    if gcra.now < allow_at {
        let retry = match gcra.increment <= gcra.tolerance {
            true => allow_at - gcra.now,
            false => -NANOS_PER_SECOND,
        };
        return Ok(gcra.reply(true, retry, gcra.tat - gcra.now, None));
    }
    gcra.taken(gcra.now, args.quantity)
}

/// What a throttle that may wait does (`WAIT ms`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThrottleWaiting {
    /// Answered now, exactly as without WAIT.
    Now(Throttle),
    /// Charged now (its TAT written), answered `served` `wait_nanos` from now, when it
    /// conforms.
    Later { served: Throttle, wait_nanos: i64 },
}

/// A throttle that would wait up to `wait_ms` to conform: taken or refused now, as
/// `throttle`; else, if it conforms within the wait, charged now (the TAT moved on by
/// its quantity, so every later call, waiting or not, conforms after it) and answered
/// when it conforms, with the reply a call taken then gets.
pub fn throttle_waiting(
    args: &ThrottleArgs,
    stored: Option<u64>,
    now: i64,
    skew: i128,
    wait_ms: i64,
) -> Result<ThrottleWaiting, ThrottleError> {
    let gcra = Gcra::new(args, stored, now, skew)?;
    let answer = refused_or_taken(&gcra, args)?;
    let wait = gcra.allow_at() - gcra.now;
    let fits = gcra.increment <= gcra.tolerance && wait <= i128::from(wait_ms) * 1_000_000;
    if !answer.limited || args.quantity == 0 || !fits {
        return Ok(ThrottleWaiting::Now(answer));
    }
    Ok(ThrottleWaiting::Later {
        served: gcra.taken(gcra.allow_at(), args.quantity)?,
        // At most a minute: within an i64.
        wait_nanos: wait as i64,
    })
}

/// A throttle waiter that is not served gives its quantity back: the stored TAT moved
/// back by its increment (never before now), and every later waiter conforms that much
/// sooner. Returns the TAT to write (None for a missing key: nothing owed) and how
/// much sooner, in nanoseconds.
pub fn give_back(
    args: &ThrottleArgs,
    stored: Option<u64>,
    now: i64,
    skew: i128,
) -> Result<(Option<u64>, i64), ThrottleError> {
    let gcra = Gcra::new(args, stored, now, skew)?;
    if stored.is_none() {
        return Ok((None, 0));
    }
    let back = (gcra.tat - gcra.increment).max(gcra.now);
    let sooner = gcra.tat - back;
    Ok((
        Some(u64::try_from(back).map_err(|_| ThrottleError::Overflow)?),
        i64::try_from(sooner).unwrap_or(i64::MAX),
    ))
}

/// Nanoseconds truncated to whole microseconds, as a double; in i64 where they fit (an
/// i128 division is a call into the compiler's runtime).
fn whole_micros(nanos: i128) -> f64 {
    match i64::try_from(nanos) {
        Ok(nanos) => (nanos / 1000) as f64,
        Err(_) => (nanos / 1000) as f64,
    }
}

/// The key's expiry for a stored TAT, in Unix milliseconds: the TAT's millisecond, as
/// redis-cell's relative expiry of the truncated milliseconds to it comes out. A key
/// expires once the server's millisecond clock passes it, so it is read at most within
/// the TAT's own millisecond after the TAT: never with a TAT a millisecond old, which
/// would answer more remaining than the burst.
pub fn expire_at_millis(tat: u64) -> i64 {
    // At most u64::MAX / 10^6, well within an i64.
    (tat / 1_000_000) as i64
}

/// A skew of whole seconds, THROTTLE-SKEW's, in nanoseconds.
pub fn skew_nanos(seconds: i64) -> i128 {
    i128::from(seconds) * NANOS_PER_SECOND
}

/// A stored TAT as redis-cell reads it: Rust's `u64` from a string (ASCII digits, an
/// optional leading `+`, leading zeros allowed, at most 2^64 − 1); None for anything
/// else, which redis-cell would abort the server on.
pub fn parse_tat(bytes: &[u8]) -> Option<u64> {
    // What the module and redis-cell write, 1 to 19 digits, cannot overflow: read
    // directly; anything else (a sign, 20 digits, garbage) by the standard parser.
    if !bytes.is_empty() && bytes.len() <= 19 {
        let mut n: u64 = 0;
        for &b in bytes {
            let digit = b.wrapping_sub(b'0');
            if digit >= 10 {
                return std::str::from_utf8(bytes).ok()?.parse().ok();
            }
            n = n * 10 + u64::from(digit);
        }
        return Some(n);
    }
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NANOS: i64 = 1_000_000_000;
    const START: i64 = 1_764_441_000 * NANOS;
    const MS: i64 = 1_000_000;
    /// Every stored TAT trusted, as redis-cell does.
    const TRUST_ALL: i128 = i128::MAX / 4;

    fn args(max_burst: i64, count: i64, period: i64, quantity: i64) -> ThrottleArgs {
        ThrottleArgs {
            key: 1,
            max_burst,
            count,
            period,
            quantity,
            wait: None,
        }
    }

    fn at(nanos: i64) -> Option<u64> {
        Some(u64::try_from(nanos).unwrap())
    }

    /// redis-cell's own table of cases (limit 5, one per second), run through one state.
    #[test]
    fn redis_cells_cases() {
        // (offset ms, quantity, limited, remaining, reset_after ms, retry_after ms)
        let cases: [(i64, i64, bool, i64, i64, i64); 15] = [
            (0, 6, true, 5, 0, -1000),
            (0, 1, false, 4, 1000, -1000),
            (0, 1, false, 3, 2000, -1000),
            (0, 1, false, 2, 3000, -1000),
            (0, 1, false, 1, 4000, -1000),
            (0, 1, false, 0, 5000, -1000),
            (0, 1, true, 0, 5000, 1000),
            (3000, 1, false, 2, 3000, -1000),
            (3100, 1, false, 1, 3900, -1000),
            (4000, 1, false, 1, 4000, -1000),
            (8000, 1, false, 4, 1000, -1000),
            (9500, 1, false, 4, 1000, -1000),
            (9500, 0, false, 4, 1000, -1000),
            (9500, 2, false, 2, 3000, -1000),
            (9500, 5, true, 2, 3000, 3000),
        ];
        let mut stored = None;
        for (i, (offset, quantity, limited, remaining, reset, retry)) in
            cases.into_iter().enumerate()
        {
            let t = throttle(
                &args(4, 1, 1, quantity),
                stored,
                START + offset * MS,
                TRUST_ALL,
            )
            .unwrap();
            assert_eq!(
                (
                    t.limited,
                    t.limit,
                    t.remaining,
                    t.reset_after_nanos,
                    t.retry_after_nanos
                ),
                (
                    limited,
                    5,
                    remaining,
                    i128::from(reset * MS),
                    i128::from(retry * MS)
                ),
                "case {i}"
            );
            stored = t.write.or(stored);
        }
    }

    #[test]
    fn a_peek_writes_nothing_and_a_refusal_writes_nothing() {
        let t = throttle(&args(2, 1, 1, 0), None, START, TRUST_ALL).unwrap();
        assert_eq!((t.limited, t.remaining, t.write), (false, 3, None));
        let t = throttle(&args(0, 1, 10, 1), at(START + 10 * NANOS), START, TRUST_ALL).unwrap();
        assert_eq!((t.limited, t.write), (true, None));
        assert_eq!(t.as_reply(), [1, 1, 0, 10, 10]);
        let t = throttle(&args(0, 1, 10, 1), None, START, TRUST_ALL).unwrap();
        assert_eq!(t.write, at(START + 10 * NANOS));
        assert_eq!(t.as_reply(), [0, 1, 0, -1, 10]);
    }

    #[test]
    fn seconds_round_up_from_a_whole_millisecond() {
        assert_eq!(reply_seconds(0), 0);
        assert_eq!(reply_seconds(999_999), 0, "under a millisecond");
        assert_eq!(reply_seconds(1_000_000), 1);
        assert_eq!(reply_seconds(1_000_000_000), 1);
        assert_eq!(reply_seconds(1_000_999_999), 1);
        assert_eq!(reply_seconds(1_001_000_000), 2);
        assert_eq!(reply_seconds(-NANOS_PER_SECOND), -1);
        assert_eq!(reply_seconds(-1_500_000_000), -1, "negative: truncated");
    }

    #[test]
    fn seconds_from_2_24_on_are_rounded_as_a_double_first() {
        // redis-cell: `as_seconds_f64() as i64`. Below 2^24 s a double tells
        // 999,999,999 ns from a whole second; from 2^24 s on it rounds them up to it.
        assert_eq!(reply_seconds(16_777_215_999_999_999), 16_777_216);
        assert_eq!(reply_seconds(16_777_216_999_999_999), 16_777_218);
        assert_eq!(reply_seconds(16_777_216_999_000_000), 16_777_217);
        // The cases of the issue: 3 × trunc(10^18 / 15) ns, 3 × trunc(10^17 / 3) ns.
        assert_eq!(reply_seconds(199_999_999_999_999_992), 200_000_001);
        assert_eq!(reply_seconds(99_999_999_999_999_996), 100_000_001);
        let t = throttle(&args(5, 15, 1_000_000_000, 3), None, START, TRUST_ALL).unwrap();
        assert_eq!(t.as_reply(), [0, 6, 3, -1, 200_000_001]);
        let t = throttle(&args(100, 3, 100_000_000, 3), None, START, TRUST_ALL).unwrap();
        assert_eq!(t.as_reply(), [0, 101, 98, -1, 100_000_001]);
        // Negative durations stay truncated: -1 s is -1.
        assert_eq!(reply_seconds(-16_777_216_999_999_999), -16_777_217);
    }

    #[test]
    fn the_interval_is_a_truncated_double_division() {
        assert_eq!(emission_interval(3, 1), Ok(333_333_333));
        assert_eq!(emission_interval(1, 60), Ok(60 * NANOS));
        assert_eq!(emission_interval(7, 100), Ok(14_285_714_285));
        assert_eq!(
            emission_interval(NANOS + 1, 1),
            Err(ThrottleError::ZeroInterval)
        );
        assert_eq!(emission_interval(NANOS, 1), Ok(1));
        assert_eq!(
            emission_interval(1, 9_223_372_036),
            Ok(9_223_372_036 * NANOS)
        );
        // Periods whose nanoseconds pass 2^63: exact in i128, then the double division.
        assert_eq!(emission_interval(10_000_000_000, 10_000_000_000), Ok(NANOS));
        assert_eq!(
            emission_interval(15, 1_000_000_000),
            Ok(66_666_666_666_666_664)
        );
        // An interval beyond the i64 range saturates, as a double-to-i64 cast does.
        assert_eq!(emission_interval(1, 10_000_000_000), Ok(i64::MAX));
        assert_eq!(emission_interval(1, i64::MAX), Ok(i64::MAX));
    }

    #[test]
    fn periods_beyond_9223372036_seconds_are_computed() {
        let t = throttle(
            &args(1, 10_000_000_000, 10_000_000_000, 1),
            None,
            START,
            TRUST_ALL,
        )
        .unwrap();
        assert_eq!(t.as_reply(), [0, 2, 1, -1, 1]);
        // One per 10^10 s: an interval of i64::MAX ns, written past 2^63.
        let t = throttle(&args(0, 1, 10_000_000_000, 1), None, START, TRUST_ALL).unwrap();
        assert_eq!(t.as_reply(), [0, 1, 0, -1, 9_223_372_037]);
        let tat = t.write.unwrap();
        assert_eq!(u128::from(tat), START as u128 + i64::MAX as u128);
        assert_eq!(expire_at_millis(tat), (tat / 1_000_000) as i64);
        // Read back: refused, the whole interval to wait.
        let t = throttle(&args(0, 1, 10_000_000_000, 1), Some(tat), START, TRUST_ALL).unwrap();
        assert_eq!(t.as_reply(), [1, 1, 0, 9_223_372_037, 9_223_372_037]);
    }

    #[test]
    fn overflows_are_errors() {
        let huge = args(i64::MAX - 1, 1, 1, 1);
        assert_eq!(
            throttle(&huge, None, START, TRUST_ALL),
            Err(ThrottleError::Overflow)
        );
        let much = args(0, 1, 1, i64::MAX);
        assert_eq!(
            throttle(&much, None, START, TRUST_ALL),
            Err(ThrottleError::Overflow)
        );
        // A TAT at the end of the u64 range is read, and refuses.
        let t = throttle(&args(0, 1, 1, 1), Some(u64::MAX), START, TRUST_ALL).unwrap();
        assert!(t.limited);
        assert_eq!(
            t.reset_after_nanos,
            i128::from(u64::MAX) - i128::from(START)
        );
    }

    #[test]
    fn tats_past_2_63_are_read_as_redis_cell_reads_them() {
        // 2^63 ns, in 2262, with a burst wide enough to reach it: numbers as redis-cell
        // 0.5.0 computes them (its run at another clock: [0 9000000001 1572718964 -1
        // 7427281037]).
        let tat = 1u64 << 63;
        let t = throttle(&args(9_000_000_000, 1, 1, 0), Some(tat), START, TRUST_ALL).unwrap();
        assert_eq!(
            t.as_reply(),
            [0, 9_000_000_001, 1_541_068_964, -1, 7_458_931_037]
        );
        let t = throttle(&args(1, 1, 1, 1), Some(tat), START, TRUST_ALL).unwrap();
        assert_eq!(t.as_reply(), [1, 2, 0, 7_458_931_036, 7_458_931_037]);
        // Taken from: the new TAT is past 2^63 too.
        let t = throttle(&args(9_000_000_000, 1, 1, 1), Some(tat), START, TRUST_ALL).unwrap();
        assert_eq!(t.write, Some(tat + 1_000_000_000));
    }

    #[test]
    fn a_tat_is_trusted_up_to_the_skew_and_a_longest_wait_beyond_the_burst_window() {
        let skew = skew_nanos(60);
        // Burst 5, one a second: a burst window of 5 s; waiters charge up to 60 s more.
        let a = args(4, 1, 1, 1);
        let edge = START + 5 * NANOS + 60 * NANOS + 60 * NANOS;
        let t = throttle(&a, at(edge), START, skew).unwrap();
        assert_eq!(t.as_reply(), [1, 5, 0, 121, 125], "kept: no credit minted");
        // A nanosecond further: read as a missing key, a fresh limiter.
        let t = throttle(&a, at(edge + 1), START, skew).unwrap();
        assert_eq!(t.as_reply(), [0, 5, 4, -1, 1]);
        assert_eq!(t.write, at(START + NANOS));
        let peek = throttle(&args(4, 1, 1, 0), at(edge + 1), START, skew).unwrap();
        assert_eq!((peek.as_reply(), peek.write), ([0, 5, 5, -1, 0], None));
        // Years ahead, or at the end of the u64 range: the same.
        for far in [START + 6 * 365 * 86_400 * NANOS, i64::MAX] {
            let t = throttle(&a, at(far), START, skew).unwrap();
            assert_eq!(t.as_reply(), [0, 5, 4, -1, 1]);
        }
        let t = throttle(&a, Some(u64::MAX), START, skew).unwrap();
        assert_eq!(t.as_reply(), [0, 5, 4, -1, 1]);
        // No skew: the burst window and a longest wait only.
        let t = throttle(&a, at(START + 65 * NANOS), START, 0).unwrap();
        assert_eq!(t.as_reply(), [1, 5, 0, 61, 65]);
        let t = throttle(&a, at(START + 65 * NANOS + 1), START, 0).unwrap();
        assert_eq!(t.as_reply(), [0, 5, 4, -1, 1]);
        // A TAT behind the clock is no matter of trust: the clock's.
        let t = throttle(&a, at(START - 100 * NANOS), START, 0).unwrap();
        assert_eq!(t.as_reply(), [0, 5, 4, -1, 1]);
    }

    #[test]
    fn wait_follows_the_quantity_or_stands_alone() {
        let parse = |words: &str| {
            let list: Vec<&[u8]> = words.split(' ').map(str::as_bytes).collect();
            parse_throttle(&list[..]).map(|a| (a.quantity, a.wait))
        };
        assert_eq!(parse("T k 1 1 1 WAIT 5"), Ok((1, Some(5))));
        assert_eq!(parse("T k 1 1 1 3 wait 0"), Ok((3, Some(0))));
        assert_eq!(parse("T k 1 1 1 3"), Ok((3, None)));
    }

    #[test]
    fn waiters_are_charged_at_arrival_and_conform_in_order() {
        // Burst 1 (max_burst 0), one a second: one now, then one a second.
        let a = args(0, 1, 1, 1);
        let first = throttle_waiting(&a, None, START, 0, 5_000).unwrap();
        let ThrottleWaiting::Now(t) = first else {
            panic!("the first fits now");
        };
        assert!(!t.limited);
        let second = throttle_waiting(&a, t.write, START, 0, 5_000).unwrap();
        let ThrottleWaiting::Later { served, wait_nanos } = second else {
            panic!("the second waits");
        };
        assert_eq!(wait_nanos, NANOS);
        assert_eq!(served.as_reply(), [0, 1, 0, -1, 1]);
        let third = throttle_waiting(&a, served.write, START, 0, 5_000).unwrap();
        let ThrottleWaiting::Later { served, wait_nanos } = third else {
            panic!("the third waits after it");
        };
        assert_eq!(wait_nanos, 2 * NANOS);
        // A plain call is refused until then, never overtaking them.
        let plain = throttle(&a, served.write, START + NANOS, 0).unwrap();
        assert_eq!(plain.as_reply()[..4], [1, 1, 0, 2]);
        // A wait too short: refused at once, nothing written, as without WAIT.
        let short = throttle_waiting(&a, served.write, START, 0, 2_500).unwrap();
        assert_eq!(
            short,
            ThrottleWaiting::Now(throttle(&a, served.write, START, 0).unwrap())
        );
        // One that leaves gives its interval back: the TAT one second sooner.
        let (back, sooner) = give_back(&a, served.write, START, 0).unwrap();
        assert_eq!((back, sooner), (at(START + 2 * NANOS), NANOS));
        assert_eq!(give_back(&a, None, START, 0).unwrap(), (None, 0));
        // A quantity above the burst never waits; a peek never does.
        let never = throttle_waiting(&args(0, 1, 1, 2), None, START, 0, 60_000).unwrap();
        assert!(matches!(never, ThrottleWaiting::Now(t) if t.limited));
        let peek = throttle_waiting(&args(0, 1, 1, 0), served.write, START, 0, 60_000).unwrap();
        assert!(matches!(peek, ThrottleWaiting::Now(_)));
    }

    #[test]
    fn remaining_divides_whole_microseconds() {
        // 3 per second: an interval of 333,333,333 ns; 666,666,665 ns of room is two
        // intervals in whole microseconds (666,666 / 333,333), one in nanoseconds.
        let a = args(2, 3, 1, 1);
        let tat = START + 3 * 333_333_333 - 666_666_665 - 333_333_333;
        let t = throttle(&a, at(tat), START, TRUST_ALL).unwrap();
        assert!(!t.limited);
        assert_eq!(t.remaining, 2);
        // An interval under a microsecond divides by zero: an infinite quotient
        // saturates, an undefined one (under a microsecond of room) casts to 0.
        let fast = args(1000, 500_000_000, 1, 1);
        assert_eq!(
            throttle(&fast, None, START, TRUST_ALL).unwrap().remaining,
            i64::MAX
        );
        let fast = args(10, 500_000_000, 1, 1);
        assert_eq!(
            throttle(&fast, None, START, TRUST_ALL).unwrap().remaining,
            0
        );
    }

    #[test]
    fn expiry_is_the_tats_millisecond() {
        let start = START as u64;
        let ms = MS as u64;
        assert_eq!(expire_at_millis(start), START / MS);
        assert_eq!(expire_at_millis(start + 1), START / MS);
        assert_eq!(expire_at_millis(start + ms - 1), START / MS);
        assert_eq!(expire_at_millis(start + ms), START / MS + 1);
        assert_eq!(expire_at_millis(u64::MAX), 18_446_744_073_709);
    }

    #[test]
    fn stored_tats_are_read_as_a_rust_u64() {
        assert_eq!(
            parse_tat(b"1764441000000000000"),
            Some(1_764_441_000_000_000_000)
        );
        assert_eq!(parse_tat(b"0"), Some(0));
        assert_eq!(parse_tat(b"+5"), Some(5));
        assert_eq!(parse_tat(b"007"), Some(7));
        assert_eq!(parse_tat(b"9223372036854775808"), Some(1 << 63));
        assert_eq!(parse_tat(b"18446744073709551615"), Some(u64::MAX));
        for bad in [
            &b""[..],
            b"+",
            b"-1",
            b"-0",
            b"++1",
            b" 1",
            b"1 ",
            b"1.5",
            b"abc",
            b"18446744073709551616",
            b"99999999999999999999",
            b"\xff",
        ] {
            assert_eq!(parse_tat(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn arguments() {
        let parse = |words: &str| {
            let list: Vec<&[u8]> = words.split(' ').map(str::as_bytes).collect();
            parse_throttle(&list[..]).map_err(|e| e.to_string())
        };
        assert_eq!(
            parse("T k 15 30 60"),
            Ok(ThrottleArgs {
                key: 1,
                max_burst: 15,
                count: 30,
                period: 60,
                quantity: 1,
                wait: None,
            })
        );
        assert_eq!(parse("T k 0 1 1 0").map(|a| a.quantity), Ok(0));
        assert_eq!(
            parse("T k 1 1 9223372037").map(|a| a.period),
            Ok(9_223_372_037)
        );
        assert_eq!(
            parse("T k 1 1 9223372036854775807").map(|a| a.period),
            Ok(i64::MAX)
        );
        assert_eq!(parse("T k +1 +2 +3 +4").map(|a| a.quantity), Ok(4));
        for (words, error) in [
            ("T k 1 1", "ERR wrong number of arguments"),
            (
                "T k 1 1 1 1 WAIT 5 WAIT 5 x",
                "ERR wrong number of arguments",
            ),
            ("T k 1 1 1 1 WAIT 5 x", "ERR syntax error: expected WAIT ms"),
            ("T k 1 1 1 1 1", "ERR syntax error: expected WAIT ms"),
            ("T k 1 1 1 WAIT", "ERR WAIT needs a number of milliseconds"),
            (
                "T k 1 1 1 WAIT 60001",
                "ERR WAIT must be an integer from 0 to 60000",
            ),
            ("T k 1 1 1 WAIT 1 WAIT 1", "ERR WAIT given more than once"),
            (
                "T k -1 1 1",
                "ERR max_burst must be an integer from 0 to 9223372036854775806",
            ),
            (
                "T k 1 0 1",
                "ERR count must be an integer from 1 to 9223372036854775807",
            ),
            (
                "T k 1 1 0",
                "ERR period must be an integer from 1 to 9223372036854775807",
            ),
            (
                "T k 1 1 9223372036854775808",
                "ERR period must be an integer from 1 to 9223372036854775807",
            ),
            (
                "T k 1 1 1 -1",
                "ERR quantity must be an integer from 0 to 9223372036854775807",
            ),
            (
                "T k 1.5 1 1",
                "ERR max_burst must be an integer from 0 to 9223372036854775806",
            ),
            (
                "T k 1 x 1",
                "ERR count must be an integer from 1 to 9223372036854775807",
            ),
        ] {
            assert_eq!(parse(words).err().as_deref(), Some(error), "{words}");
        }
    }

    proptest! {
        #[test]
        fn reply_seconds_as_in_i128(nanos in any::<i64>()) {
            prop_assert_eq!(reply_seconds(i128::from(nanos)), reply_seconds_wide(i128::from(nanos)));
        }

        #[test]
        fn tats_read_as_the_standard_parser(text in "[+]?[0-9]{0,21}") {
            prop_assert_eq!(parse_tat(text.as_bytes()), text.parse::<u64>().ok());
        }
    }

    proptest! {
        /// Whatever the arguments, state and clock: an error or a sound result, and a
        /// limiter never lets through more than its burst plus what time has refilled.
        #[test]
        fn total_and_never_over_the_burst(
            max_burst in 0i64..50,
            count in 1i64..1000,
            period in 1i64..100,
            steps in proptest::collection::vec((0i64..2_000_000_000, 0i64..4), 1..60),
        ) {
            let mut now = START;
            let mut stored: Option<u64> = None;
            let mut taken = 0i64;
            let interval = emission_interval(count, period).unwrap();
            for (dt, quantity) in steps {
                now += dt;
                // The key expires once the millisecond clock passes its expiry.
                if stored.is_some_and(|tat| expire_at_millis(tat) < now.div_euclid(MS)) {
                    stored = None;
                }
                let a = args(max_burst, count, period, quantity);
                let t = throttle(&a, stored, now, TRUST_ALL).unwrap();
                // Within the TAT's own millisecond a little more than the burst may
                // show, as in redis-cell.
                prop_assert!(t.remaining >= 0 && t.remaining <= max_burst + 1 + MS / interval);
                if !t.limited {
                    taken += quantity;
                }
                stored = t.write.or(stored);
            }
            let refilled = (now - START) / interval;
            prop_assert!(taken <= max_burst + 1 + refilled + 1, "{} > {} + {}", taken, max_burst + 1, refilled);
        }

        /// Whatever is stored, a limiter is back to its full burst within its burst
        /// window plus the skew.
        #[test]
        fn never_locked_past_the_burst_window_and_the_skew(
            max_burst in 0i64..1000,
            count in 1i64..1000,
            period in 1i64..100_000,
            quantity in 0i64..1000,
            stored in proptest::option::of(any::<u64>()),
            skew_seconds in 0i64..100_000,
        ) {
            let a = args(max_burst, count, period, quantity);
            let skew = skew_nanos(skew_seconds);
            let t = throttle(&a, stored, START, skew).unwrap();
            let tolerance = i128::from(emission_interval(count, period).unwrap()) * i128::from(max_burst + 1);
            prop_assert!(t.reset_after_nanos <= tolerance + skew, "{:?}", t);
        }

        #[test]
        fn any_input_is_an_answer_or_an_error(
            max_burst in 0i64..i64::MAX,
            count in 1i64..i64::MAX,
            period in 1i64..=i64::MAX,
            quantity in 0i64..i64::MAX,
            stored in proptest::option::of(any::<u64>()),
            now in 0i64..i64::MAX,
        ) {
            if let Ok(t) = throttle(&args(max_burst, count, period, quantity), stored, now, TRUST_ALL) {
                // What is written is never behind the clock, nor past what it reads.
                if let Some(tat) = t.write {
                    prop_assert!(i128::from(tat) >= i128::from(now));
                }
            }
        }
    }
}
