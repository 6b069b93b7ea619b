//! The token bucket of `lua/token_bucket.lua`, step for step.
//!
//! Every operation is done in `f64` in the script's order, so that the module and the
//! script compute the same bits from the same stored fields and the same clock.

use crate::args::{set_once, ArgError, ArgList, Args};
use crate::replay;
use crate::wait::{self, MAX_WAIT_SECONDS};

/// A bucket's limit: `count` tokens, refilled at `count` per `period` seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limit {
    pub count: f64,
    pub period: f64,
}

/// What the bucket's hash holds: fields `tokens` and `ts` (Unix seconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct State {
    pub tokens: f64,
    pub ts: f64,
}

/// The three integers a TAKE answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub allowed: bool,
    /// floor(tokens left after the call).
    pub tokens_left: i64,
    /// Whole seconds until `cost` fits, 0 when allowed, -1 when it never fits.
    pub retry_after: i64,
}

impl Verdict {
    pub fn as_reply(&self) -> [i64; 3] {
        [i64::from(self.allowed), self.tokens_left, self.retry_after]
    }
}

/// The outcome of one take: the verdict and the state to write back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Take {
    pub verdict: Verdict,
    pub state: State,
}

impl Limit {
    fn rate(&self) -> f64 {
        self.count / self.period
    }

    /// Seconds from a call until the bucket it leaves with `tokens` is full again, as
    /// its key's expiry counts them: a period (what the script's `EXPIRE` always gave),
    /// and, for a bucket its waiters charged ahead (tokens below zero), the time to
    /// refill what they owe too, at most [`MAX_WAIT_SECONDS`] more.
    pub fn ttl_seconds(&self, tokens: f64) -> f64 {
        self.period + lua_min(lua_max(0.0, -tokens) / self.rate(), MAX_WAIT_SECONDS)
    }

    /// The fewest tokens a bucket can hold: charged ahead by waiters whose tokens all
    /// refill within the longest wait. A stored count below it came from no waiter (a
    /// stray write) and reads as missing, that is full.
    fn fewest_tokens(&self) -> f64 {
        -(self.count + self.rate() * MAX_WAIT_SECONDS)
    }
}

/// Takes `cost` tokens from a bucket whose hash held `stored` (None when a field is
/// missing or not a finite number), at `now` seconds since the Unix epoch.
///
/// A cost above the count never fits. The script compares the two as doubles, which
/// agrees for every cost a double holds exactly (up to 2^53, as every count); the
/// integers are compared first, so a larger cost is refused even where its double
/// would round down to the count.
pub fn take(limit: Limit, cost: i64, stored: Option<State>, now: f64) -> Take {
    let State { tokens, ts } = stored.unwrap_or(State {
        tokens: limit.count,
        ts: now,
    });
    let never_fits = cost > limit.count as i64;
    let cost = cost as f64;
    let rate = limit.rate();
    let elapsed = lua_max(0.0, now - ts);
    let mut tokens = lua_min(limit.count, tokens + elapsed * rate);
    let verdict = if never_fits {
        Verdict {
            allowed: false,
            tokens_left: 0,
            retry_after: -1,
        }
    } else if tokens >= cost {
        tokens -= cost;
        Verdict {
            allowed: true,
            tokens_left: 0,
            retry_after: 0,
        }
    } else {
        Verdict {
            allowed: false,
            tokens_left: 0,
            retry_after: ((cost - tokens) / rate).ceil() as i64,
        }
    };
    Take {
        verdict: Verdict {
            // A bucket its waiters charged ahead holds fewer than none: none are left.
            tokens_left: (tokens.floor() as i64).max(0),
            ..verdict
        },
        state: State {
            tokens,
            ts: lua_max(ts, now),
        },
    }
}

/// What a refund leaves: the state to write (None for a missing bucket, which reads as
/// full, so nothing is written), the whole tokens left, QAG.TAKE's second element, and
/// the tokens it added (after the refill, never above the count): by that much the
/// bucket's waiters come sooner (`refill_micros`). A waiter that is not served (its
/// client gone or unblocked) gives its cost back as a refund.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Refund {
    pub state: Option<State>,
    pub tokens_left: i64,
    pub given: f64,
}

/// Gives `amount` tokens back to a bucket: refilled to `now` first, exactly as a take
/// refills it (a take of nothing), so the stored time moves to now and no credit is
/// minted or lost, then `amount` added, never above the count.
pub fn refund(limit: Limit, amount: i64, stored: Option<State>, now: f64) -> Refund {
    if stored.is_none() {
        return Refund {
            state: None,
            tokens_left: limit.count as i64,
            given: 0.0,
        };
    }
    let refilled = take(limit, 0, stored, now).state;
    let tokens = lua_min(limit.count, refilled.tokens + amount as f64);
    Refund {
        state: Some(State { tokens, ..refilled }),
        tokens_left: (tokens.floor() as i64).max(0),
        given: lua_max(0.0, tokens - refilled.tokens),
    }
}

/// What a take that may wait does (`WAIT ms`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Waiting {
    /// Answered now, exactly as a take without WAIT: allowed, or refused (a cost that
    /// never fits, or tokens that would not refill within the wait).
    Now(Take),
    /// Charged now, the bucket left `state` (below zero: the waiter owes its cost),
    /// answered allowed `wait_micros` from now, when its tokens have refilled.
    Later { state: State, wait_micros: i64 },
}

/// A take that would wait up to `wait_ms` for its tokens. Allowed now, or refused, as
/// `take`; else, if its tokens refill within the wait, charged now and answered when
/// they have: since every earlier waiter charged the bucket already, its tokens come
/// after theirs, and waiters are served in the order they arrived. A call that does not
/// wait never overtakes them either: it finds the bucket below zero until the last
/// waiter's tokens have refilled. Nothing here depends on waiters but the stored count.
pub fn take_waiting(
    limit: Limit,
    cost: i64,
    stored: Option<State>,
    now: f64,
    wait_ms: i64,
) -> Waiting {
    let outcome = take(limit, cost, stored, now);
    if outcome.verdict.allowed || outcome.verdict.retry_after < 0 {
        return Waiting::Now(outcome);
    }
    let State { tokens, ts } = outcome.state;
    // A stored time ahead of the clock refills nothing until the clock reaches it.
    let wait = lua_max(0.0, ts - now) + (cost as f64 - tokens) / limit.rate();
    let wait_micros = (wait * 1e6).ceil();
    if wait_micros > wait_ms as f64 * 1000.0 {
        return Waiting::Now(outcome);
    }
    Waiting::Later {
        state: State {
            tokens: tokens - cost as f64,
            ts,
        },
        wait_micros: wait_micros as i64,
    }
}

/// How long `tokens` take to refill, in microseconds rounded down: how much sooner a
/// waiter's tokens exist once that many were given back ahead of it (never before they
/// do).
pub fn refill_micros(limit: Limit, tokens: f64) -> i64 {
    (tokens / limit.rate() * 1e6).floor() as i64
}

/// The stored state the module takes from:/// The stored state the module takes from: `stored`, unless its `ts` is more than one
/// period ahead of the clock. A bucket's own calls write the clock's time, or keep a
/// later one, so a `ts` ahead comes from a clock that was ahead (a failover to a
/// primary whose clock is behind) or from another writer. Up to a period ahead it is
/// kept: the bucket refills nothing until the clock reaches it, so a clock stepped back
/// mints no credit, and is locked for at most that period. Further ahead (a clock
/// stepped far forward, a stray write) the bucket reads as missing, that is full, which
/// is what a period's refill gives anyway. So does a count of tokens below any that
/// waiters can leave (`Limit::fewest_tokens`). The script trusts any `ts` and any count
/// (and recovers once its key expires, at most a period and a longest wait after the
/// last call).
pub fn trusted(stored: Option<State>, limit: Limit, now: f64) -> Option<State> {
    stored.filter(|state| state.ts <= now + limit.period && state.tokens >= limit.fewest_tokens())
}

/// Lua 5.1's math.max: the first argument unless a later one compares greater, so a
/// NaN argument never wins.
fn lua_max(a: f64, b: f64) -> f64 {
    if b > a {
        b
    } else {
        a
    }
}

/// Lua 5.1's math.min, the mirror of `lua_max`.
fn lua_min(a: f64, b: f64) -> f64 {
    if b < a {
        b
    } else {
        a
    }
}

/// Seconds since the Unix epoch as the script computes them from TIME:
/// seconds + microseconds / 1e6.
pub fn seconds_from_micros(micros: i64) -> f64 {
    (micros.div_euclid(1_000_000)) as f64 + (micros.rem_euclid(1_000_000)) as f64 / 1e6
}

/// When a bucket is full again, in Unix milliseconds rounded up: a missing bucket
/// reads as full, so its key may expire then. It refills from its stored time `ts`, so
/// the count starts there when `ts` is ahead of the clock (a clock stepped back refills
/// nothing until it reaches `ts`), else now: then `now + ceil(ttl)`, `ttl` being
/// `Limit::ttl_seconds`, what the script's `EXPIRE` sets.
pub fn full_at_millis(now_micros: i64, ts: f64, ttl: f64) -> i64 {
    let refill_from = if ts > seconds_from_micros(now_micros) {
        // Saturates for a time beyond the i64 range: such a bucket never refills.
        (ts * 1e6).ceil() as i64
    } else {
        now_micros
    };
    let ttl = ttl.ceil() as i64;
    let full_micros = refill_from.saturating_add(ttl.saturating_mul(1_000_000));
    full_micros.div_euclid(1000) + i64::from(full_micros.rem_euclid(1000) != 0)
}

/// How much later than its refill a bucket's key may expire: a quarter of
/// `ceil(period)` in whole seconds (integer division), at least one second.
pub fn expiry_slack_millis(period: f64) -> i64 {
    ((period.ceil() as i64) / 4).max(1).saturating_mul(1000)
}

/// The expiry of a bucket's key after a call that left `state`, given the one it has
/// (`current`, Unix milliseconds, -1 for none): kept while it is from the refill
/// (`full_at_millis`) to a slack later (`expiry_slack_millis`), else moved to a slack
/// after the refill. So a key's expiry moves, and replicates a `PEXPIREAT`, at most
/// once a slack however often the bucket is called, and the key outlives its refill by
/// at most a slack.
pub fn expiry_after_call(current: i64, now_micros: i64, state: &State, limit: Limit) -> i64 {
    let full = full_at_millis(now_micros, state.ts, limit.ttl_seconds(state.tokens));
    let latest = full.saturating_add(expiry_slack_millis(limit.period));
    match (full..=latest).contains(&current) {
        true => current,
        false => latest,
    }
}

/// Reads a stored field as the scripts' Lua reads it (`tonumber`): a finite number,
/// else nothing. What qag writes, a decimal number, is read at once; anything else
/// (blanks around it, hexadecimal, a NUL after it: values no call writes) as C's strtod
/// reads it, which is what Lua calls (`number::c_number`).
pub fn parse_field(bytes: &[u8]) -> Option<f64> {
    crate::args::parse_number(bytes.trim_ascii())
        .or_else(|| crate::number::c_number(bytes).filter(|value| value.is_finite()))
}

/// Reads both fields; a bucket with either missing or unreadable counts as full.
pub fn parse_state(tokens: Option<&[u8]>, ts: Option<&[u8]>) -> Option<State> {
    Some(State {
        tokens: parse_field(tokens?)?,
        ts: parse_field(ts?)?,
    })
}

/// Largest count: every integer up to 2^53 is exact in an f64.
pub const COUNT_MAX: i64 = 1 << 53;
/// Period bounds in seconds: the clock's resolution, and about 317 years.
pub const PERIOD_MIN: (f64, &str) = (1e-6, "0.000001");
pub const PERIOD_MAX: (f64, &str) = (1e10, "10000000000");

/// `count period` of one bucket.
pub fn parse_limit<L: ArgList + ?Sized>(args: &mut Args<'_, L>) -> Result<Limit, ArgError> {
    let count = args.integer("count", 1, COUNT_MAX)?;
    let period = args.number("period", PERIOD_MIN, PERIOD_MAX)?;
    Ok(Limit {
        count: count as f64,
        period,
    })
}

/// The options after a bucket's limits.
struct Options {
    cost: i64,
    id: Option<replay::IdArg>,
    wait: Option<i64>,
}

/// The options after a bucket's limits: `[COST n]` and, on the commands that count
/// (`counts`), `[ID request-id] [WAIT ms]`, in any order, each once.
fn parse_options<L: ArgList + ?Sized>(
    args: &mut Args<'_, L>,
    counts: bool,
) -> Result<Options, ArgError> {
    let (mut cost, mut id, mut wait) = (None, None, None);
    if args.remaining() > 0 {
        let (options, expected): (&[&str], _) = match counts {
            true => (&["COST", "ID", "WAIT"], "COST n, ID request-id or WAIT ms"),
            false => (&["COST"], "COST n"),
        };
        while let Some(option) = args.option(options, expected)? {
            match option {
                0 => set_once(&mut cost, args.integer("cost", 1, i64::MAX)?, "COST")?,
                1 => set_once(&mut id, replay::parse_id(args)?, "ID")?,
                _ => wait::parse_wait(args, &mut wait)?,
            }
        }
    }
    Ok(Options {
        cost: cost.unwrap_or(1),
        id,
        wait,
    })
}

/// QAG.TAKE and QAG.PEEK: `key count period [COST n]`, and TAKE's `[ID request-id]
/// [WAIT ms]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TakeArgs {
    pub key: usize,
    pub limit: Limit,
    pub cost: i64,
    /// The argument holding the request id, when given.
    pub id: Option<replay::IdArg>,
    /// How long the caller would wait for its tokens, in milliseconds, when given.
    pub wait: Option<i64>,
}

/// QAG.TAKE's arguments (`counts`), or QAG.PEEK's, which counts nothing and takes no
/// id and no wait.
pub fn parse_take<L: ArgList + ?Sized>(list: &L, counts: bool) -> Result<TakeArgs, ArgError> {
    let mut args = Args::new(list);
    args.expect_count(3, 11)?;
    let key = args.key()?;
    let limit = parse_limit(&mut args)?;
    let Options { cost, id, wait } = parse_options(&mut args, counts)?;
    Ok(TakeArgs {
        key,
        limit,
        cost,
        id,
        wait,
    })
}

/// QAG.TAKE2: `ckey ccount cperiod kkey kcount kperiod [COST n] [ID request-id]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TakePairArgs {
    pub client: TakeArgs,
    pub key: TakeArgs,
}

pub fn parse_take_pair<L: ArgList + ?Sized>(list: &L) -> Result<TakePairArgs, ArgError> {
    let mut args = Args::new(list);
    args.expect_count(6, 14)?;
    let client_key = args.key()?;
    let client_limit = parse_limit(&mut args)?;
    let key_key = args.key()?;
    let key_limit = parse_limit(&mut args)?;
    let Options { cost, id, wait } = parse_options(&mut args, true)?;
    Ok(TakePairArgs {
        client: TakeArgs {
            key: client_key,
            limit: client_limit,
            cost,
            id,
            wait,
        },
        key: TakeArgs {
            key: key_key,
            limit: key_limit,
            cost,
            id,
            wait,
        },
    })
}

/// QAG.REFUND: `key count period n [ID request-id]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RefundArgs {
    pub key: usize,
    pub limit: Limit,
    pub amount: i64,
    pub id: Option<replay::IdArg>,
}

pub fn parse_refund<L: ArgList + ?Sized>(list: &L) -> Result<RefundArgs, ArgError> {
    let mut args = Args::new(list);
    args.expect_count(4, 8)?;
    let key = args.key()?;
    let limit = parse_limit(&mut args)?;
    let amount = args.integer("n", 1, i64::MAX)?;
    let mut id = None;
    while args.option(&["ID"], "ID request-id")?.is_some() {
        set_once(&mut id, replay::parse_id(&mut args)?, "ID")?;
    }
    Ok(RefundArgs {
        key,
        limit,
        amount,
        id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: f64 = 1_764_441_000.25;

    fn parse<T>(f: impl Fn(&[&[u8]]) -> Result<T, ArgError>, words: &str) -> Result<T, String> {
        let list: Vec<&[u8]> = words.split(' ').map(str::as_bytes).collect();
        f(&list[..]).map_err(|e| e.to_string())
    }

    #[test]
    fn take_arguments() {
        let t = parse(|l| parse_take(l, true), "TAKE k 60 60").unwrap();
        assert_eq!((t.key, t.limit, t.cost), (1, limit(60.0, 60.0), 1));
        let t = parse(|l| parse_take(l, true), "TAKE k 1 0.5 cost 7").unwrap();
        assert_eq!((t.limit, t.cost), (limit(1.0, 0.5), 7));
        let t = parse(
            |l| parse_take(l, true),
            "TAKE k 9007199254740992 10000000000",
        )
        .unwrap();
        assert_eq!(t.limit, limit(9007199254740992.0, 1e10));
        for (words, error) in [
            ("TAKE k 60", "ERR wrong number of arguments"),
            ("TAKE k 60 60 COST 1 COST", "ERR wrong number of arguments"),
            (
                "TAKE k 0 60",
                "ERR count must be an integer from 1 to 9007199254740992",
            ),
            (
                "TAKE k -1 60",
                "ERR count must be an integer from 1 to 9007199254740992",
            ),
            (
                "TAKE k 9007199254740993 60",
                "ERR count must be an integer from 1 to 9007199254740992",
            ),
            (
                "TAKE k 1.5 60",
                "ERR count must be an integer from 1 to 9007199254740992",
            ),
            (
                "TAKE k x 60",
                "ERR count must be an integer from 1 to 9007199254740992",
            ),
            (
                "TAKE k 60 0",
                "ERR period must be a number from 0.000001 to 10000000000",
            ),
            (
                "TAKE k 60 -1",
                "ERR period must be a number from 0.000001 to 10000000000",
            ),
            (
                "TAKE k 60 nan",
                "ERR period must be a number from 0.000001 to 10000000000",
            ),
            (
                "TAKE k 60 inf",
                "ERR period must be a number from 0.000001 to 10000000000",
            ),
            (
                "TAKE k 60 1e400",
                "ERR period must be a number from 0.000001 to 10000000000",
            ),
            (
                "TAKE k 60 60 COST 0",
                "ERR cost must be an integer from 1 to 9223372036854775807",
            ),
            (
                "TAKE k 60 60 COST 99999999999999999999",
                "ERR cost must be an integer from 1 to 9223372036854775807",
            ),
            (
                "TAKE k 60 60 PRICE 2",
                "ERR syntax error: expected COST n, ID request-id or WAIT ms",
            ),
            (
                "TAKE k 60 60 COST 1 COST 2",
                "ERR COST given more than once",
            ),
            ("TAKE k 60 60 ID a ID b", "ERR ID given more than once"),
            ("TAKE k 60 60 ID", "ERR wrong number of arguments"),
            (
                "TAKE k 60 60 ID a COST 1 ID",
                "ERR wrong number of arguments",
            ),
            ("TAKE k 60 60 COST", "ERR wrong number of arguments"),
        ] {
            assert_eq!(
                parse(|l| parse_take(l, true), words).err().as_deref(),
                Some(error),
                "{words}"
            );
        }
    }

    #[test]
    fn ids_are_taken_by_take_but_not_by_peek() {
        let index = |id: Option<replay::IdArg>| id.map(|id| id.index);
        let t = parse(|l| parse_take(l, true), "TAKE k 60 60 ID req-1 COST 2").unwrap();
        assert_eq!((t.cost, index(t.id)), (2, Some(5)));
        let t = parse(|l| parse_take(l, true), "TAKE k 60 60 id x").unwrap();
        assert_eq!((t.cost, index(t.id)), (1, Some(5)));
        // KEEP right after the id: how long it is remembered.
        let t = parse(|l| parse_take(l, true), "TAKE k 60 60 ID x keep 5 COST 2").unwrap();
        let keep = replay::IdArg {
            index: 5,
            keep_seconds: Some(5),
        };
        assert_eq!((t.cost, t.id), (2, Some(keep)));
        let t = parse(|l| parse_take(l, true), "TAKE k 60 60 ID KEEP KEEP 86400").unwrap();
        assert_eq!(t.id.and_then(|id| id.keep_seconds), Some(86_400));
        for (text, error) in [
            (
                "TAKE k 60 60 ID x KEEP 0",
                "ERR KEEP must be an integer from 1 to 86400",
            ),
            (
                "TAKE k 60 60 ID x KEEP 86401",
                "ERR KEEP must be an integer from 1 to 86400",
            ),
            (
                "TAKE k 60 60 ID x KEEP 1.5",
                "ERR KEEP must be an integer from 1 to 86400",
            ),
            ("TAKE k 60 60 ID x KEEP", "ERR wrong number of arguments"),
            (
                "TAKE k 60 60 KEEP 5",
                "ERR syntax error: expected COST n, ID request-id or WAIT ms",
            ),
            (
                "TAKE k 60 60 ID x KEEP 5 KEEP 5",
                "ERR syntax error: expected COST n, ID request-id or WAIT ms",
            ),
        ] {
            assert_eq!(
                parse(|l| parse_take(l, true), text).err().as_deref(),
                Some(error),
                "{text}"
            );
        }
        assert_eq!(
            parse(|l| parse_take(l, true), "TAKE k 60 60").unwrap().id,
            None
        );
        let long = format!("TAKE k 60 60 ID {}", "x".repeat(129));
        assert_eq!(
            parse(|l| parse_take(l, true), &long).err().as_deref(),
            Some("ERR ID must be 1 to 128 bytes")
        );
        let at_most = format!("TAKE k 60 60 ID {}", "x".repeat(128));
        assert!(parse(|l| parse_take(l, true), &at_most).is_ok());
        assert_eq!(
            parse(|l| parse_take(l, true), "TAKE k 60 60 ID ")
                .err()
                .as_deref(),
            Some("ERR ID must be 1 to 128 bytes")
        );
        assert_eq!(
            parse(|l| parse_take(l, false), "PEEK k 60 60 ID x")
                .err()
                .as_deref(),
            Some("ERR syntax error: expected COST n")
        );
        let p = parse(|l| parse_take_pair(l), "TAKE2 c 1 1 k 2 2 ID r COST 3").unwrap();
        assert_eq!(
            (index(p.client.id), index(p.key.id), p.client.cost),
            (Some(8), Some(8), 3)
        );
        let r = parse(|l| parse_refund(l), "REFUND k 60 60 2 ID r KEEP 9").unwrap();
        assert_eq!((r.amount, index(r.id)), (2, Some(6)));
        assert_eq!(r.id.and_then(|id| id.keep_seconds), Some(9));
    }

    #[test]
    fn take_pair_arguments() {
        let p = parse(|l| parse_take_pair(l), "TAKE2 c 10 1 k 60 60 COST 2").unwrap();
        assert_eq!(
            (p.client.key, p.client.limit, p.client.cost),
            (1, limit(10.0, 1.0), 2)
        );
        assert_eq!(
            (p.key.key, p.key.limit, p.key.cost),
            (4, limit(60.0, 60.0), 2)
        );
        for (words, error) in [
            ("TAKE2 c 10 1 k 60", "ERR wrong number of arguments"),
            (
                "TAKE2 c 10 1 k 60 60 COST 1 COST 2",
                "ERR COST given more than once",
            ),
            (
                "TAKE2 c 10 1 k 60 60 COST 1 ID a COST 2",
                "ERR COST given more than once",
            ),
            (
                "TAKE2 c 10 1 k 60 60 COST 1 ID a KEEP 1 WAIT 5 COST 2",
                "ERR wrong number of arguments",
            ),
            (
                "TAKE2 c 10 1 k 60 60 X 1",
                "ERR syntax error: expected COST n, ID request-id or WAIT ms",
            ),
            (
                "TAKE2 c 10 1 k 0 60",
                "ERR count must be an integer from 1 to 9007199254740992",
            ),
        ] {
            assert_eq!(
                parse(|l| parse_take_pair(l), words).err().as_deref(),
                Some(error),
                "{words}"
            );
        }
    }

    fn limit(count: f64, period: f64) -> Limit {
        Limit { count, period }
    }

    #[test]
    fn a_missing_bucket_is_full() {
        let t = take(limit(10.0, 60.0), 1, None, NOW);
        assert_eq!(t.verdict.as_reply(), [1, 9, 0]);
        assert_eq!(
            t.state,
            State {
                tokens: 9.0,
                ts: NOW
            }
        );
    }

    #[test]
    fn a_burst_of_exactly_count_then_refusal_with_retry() {
        let l = limit(5.0, 60.0);
        let mut state = None;
        for left in (0..5).rev() {
            let t = take(l, 1, state, NOW);
            assert_eq!(t.verdict.as_reply(), [1, left, 0]);
            state = Some(t.state);
        }
        let t = take(l, 1, state, NOW);
        // 5 tokens a minute: one token every 12 s.
        assert_eq!(t.verdict.as_reply(), [0, 0, 12]);
        assert_eq!(
            t.state,
            State {
                tokens: 0.0,
                ts: NOW
            }
        );
    }

    #[test]
    fn refill_is_linear_and_capped_at_count() {
        let l = limit(10.0, 10.0);
        let empty = Some(State {
            tokens: 0.0,
            ts: NOW,
        });
        let t = take(l, 1, empty, NOW + 2.5);
        assert_eq!(t.verdict.as_reply(), [1, 1, 0]);
        assert_eq!(t.state.tokens, 1.5);
        let t = take(l, 1, empty, NOW + 1_000.0);
        assert_eq!(t.verdict.as_reply(), [1, 9, 0]);
    }

    #[test]
    fn retry_is_the_whole_seconds_until_cost_fits() {
        let l = limit(10.0, 100.0); // 0.1 token/s
        let t = take(
            l,
            3,
            Some(State {
                tokens: 1.05,
                ts: NOW,
            }),
            NOW,
        );
        // (3 - 1.05) / 0.1 = 19.5 s -> 20.
        assert_eq!(t.verdict.as_reply(), [0, 1, 20]);
        assert_eq!(t.state.tokens, 1.05, "a refusal spends nothing");
    }

    #[test]
    fn cost_larger_than_count_never_fits() {
        let t = take(limit(3.0, 1.0), 4, None, NOW);
        assert_eq!(t.verdict.as_reply(), [0, 3, -1]);
        assert_eq!(t.state.tokens, 3.0);
    }

    #[test]
    fn a_stored_time_ahead_of_the_clock_mints_nothing_and_stays() {
        let ahead = State {
            tokens: 2.0,
            ts: NOW + 100.0,
        };
        let t = take(limit(10.0, 1.0), 1, Some(ahead), NOW);
        assert_eq!(t.verdict.as_reply(), [1, 1, 0]);
        assert_eq!(
            t.state,
            State {
                tokens: 1.0,
                ts: NOW + 100.0
            }
        );
    }

    #[test]
    fn a_ts_is_trusted_up_to_one_period_ahead() {
        let l = limit(10.0, 60.0);
        let empty_at = |ts: f64| Some(State { tokens: 0.0, ts });
        for ts in [NOW - 1e9, NOW, NOW + 30.0, NOW + 60.0] {
            assert_eq!(trusted(empty_at(ts), l, NOW), empty_at(ts), "{ts}");
        }
        for ts in [NOW + 60.001, NOW + 1e9, 1e300] {
            assert_eq!(trusted(empty_at(ts), l, NOW), None, "{ts}");
        }
        assert_eq!(trusted(None, l, NOW), None);
        // Within the period: no refill until ts; beyond it: a full bucket.
        let t = take(l, 1, trusted(empty_at(NOW + 60.0), l, NOW), NOW);
        assert_eq!(t.verdict.as_reply(), [0, 0, 6]);
        let t = take(l, 1, trusted(empty_at(2e9), l, NOW), NOW);
        assert_eq!(t.verdict.as_reply(), [1, 9, 0]);
        assert_eq!(t.state.ts, NOW);
    }

    proptest! {
        /// Whatever time is stored, the first take writes a `ts` at most a period
        /// ahead, so two periods later the bucket is full again: it is locked for at
        /// most a period, then refills.
        #[test]
        fn never_locked_past_a_period(
            count in 1u64..=1000,
            period in 1e-3f64..1e6,
            tokens in 0f64..1e3,
            ahead in 0f64..1e12,
        ) {
            let l = Limit { count: count as f64, period };
            let stored = Some(State { tokens, ts: NOW + ahead });
            let first = take(l, count as i64, trusted(stored, l, NOW), NOW);
            prop_assert!(first.state.ts <= NOW + period);
            let later = NOW + 2.0 * period;
            let t = take(l, count as i64, trusted(Some(first.state), l, later), later);
            prop_assert!(t.verdict.allowed, "{:?} then {:?}", first, t);
        }
    }

    #[test]
    fn a_lowered_count_caps_stored_tokens() {
        let t = take(
            limit(5.0, 1.0),
            1,
            Some(State {
                tokens: 50.0,
                ts: NOW,
            }),
            NOW,
        );
        assert_eq!(t.verdict.as_reply(), [1, 4, 0]);
    }

    #[test]
    fn seconds_match_the_scripts_time_arithmetic() {
        let micros = 1_764_441_000_123_456_i64;
        assert_eq!(
            seconds_from_micros(micros),
            1_764_441_000.0 + 123_456.0 / 1e6
        );
        assert_eq!(seconds_from_micros(-1), -1.0 + 999_999.0 / 1e6);
    }

    #[test]
    fn full_is_now_plus_ceil_period_in_whole_milliseconds() {
        let now = 1_000_000_500; // 1,000.0005 s
        let at = |now_micros: i64, period: f64| {
            full_at_millis(now_micros, seconds_from_micros(now_micros), period)
        };
        assert_eq!(at(now, 0.25), 1_001_001);
        assert_eq!(at(now, 1.0), 1_001_001);
        assert_eq!(at(1_000_000_000, 31.0), 1_031_000);
        assert_eq!(at(now, 60.0), 1_060_001);
        assert_eq!(at(now, 1e10), 10_000_001_000_001);
    }

    #[test]
    fn the_slack_is_a_quarter_period_in_whole_seconds() {
        assert_eq!(expiry_slack_millis(0.25), 1000);
        assert_eq!(expiry_slack_millis(7.0), 1000);
        assert_eq!(expiry_slack_millis(8.0), 2000);
        assert_eq!(expiry_slack_millis(60.0), 15_000);
        assert_eq!(expiry_slack_millis(3600.0), 900_000);
    }

    #[test]
    fn the_expiry_moves_only_out_of_its_slack() {
        let after = |current: i64, now_s: i64| {
            let now = now_s * 1_000_000;
            let state = State {
                tokens: 0.0,
                ts: seconds_from_micros(now),
            };
            expiry_after_call(current, now, &state, limit(60.0, 60.0))
        };
        // A new key: a slack after its refill.
        assert_eq!(after(-1, 1_000), 1_075_000);
        // Called again within the slack: kept, up to the call whose refill is the expiry.
        assert_eq!(after(1_075_000, 1_001), 1_075_000);
        assert_eq!(after(1_075_000, 1_015), 1_075_000);
        // Past it: moved a slack on.
        assert_eq!(after(1_075_000, 1_016), 1_091_000);
        // An expiry later than the slack (set by hand) comes back to the rule.
        assert_eq!(after(1_200_000, 1_000), 1_075_000);
    }

    #[test]
    fn a_stored_time_ahead_of_the_clock_delays_the_expiry_to_its_refill() {
        let now = 1_000_000_000; // 1,000 s
                                 // Stored 30 s ahead: full 10 s after that, not 10 s after now.
        assert_eq!(full_at_millis(now, 1_030.0, 10.0), 1_040_000);
        assert_eq!(full_at_millis(now, 1_030.000_000_5, 10.0), 1_040_001);
        let ahead = State {
            tokens: 1.0,
            ts: 1_030.0,
        };
        assert_eq!(
            expiry_after_call(-1, now, &ahead, limit(5.0, 10.0)),
            1_042_000
        );
        // A stored time behind the clock changes nothing.
        assert_eq!(full_at_millis(now, 900.0, 10.0), 1_010_000);
        // A time no clock reaches: the key never expires, nothing overflows.
        assert_eq!(full_at_millis(now, 1e300, 10.0), i64::MAX / 1000 + 1);
        let never = State {
            tokens: 1.0,
            ts: 1e300,
        };
        assert_eq!(
            expiry_after_call(-1, now, &never, limit(5.0, 1e10)),
            i64::MAX / 1000 + 1 + 2_500_000_000_000
        );
    }

    #[test]
    fn a_cost_above_the_count_never_fits_even_where_a_double_rounds_it_down() {
        let count = (1u64 << 53) as f64;
        let t = take(limit(count, 1.0), (1 << 53) + 1, None, NOW);
        assert_eq!(t.verdict.as_reply(), [0, 1 << 53, -1]);
        assert_eq!(t.state.tokens, count, "nothing spent");
        let t = take(limit(count, 1.0), 1 << 53, None, NOW);
        assert_eq!(t.verdict.as_reply(), [1, 0, 0], "the count itself fits");
        let t = take(limit(3.0, 1.0), i64::MAX, None, NOW);
        assert_eq!(t.verdict.as_reply(), [0, 3, -1]);
    }

    proptest! {
        #[test]
        fn expiry_is_from_the_refill_to_a_slack_later(
            now in 0i64..4_000_000_000_000_000,
            period in 0.000001f64..1e10,
            current in -1i64..5_000_000_000_000_000,
        ) {
            let state = State { tokens: 0.5, ts: seconds_from_micros(now) };
            let at = expiry_after_call(current, now, &state, limit(3.0, period));
            let full = (now + period.ceil() as i64 * 1_000_000 + 999) / 1000;
            let slack = ((period.ceil() as i64) / 4).max(1) * 1000;
            prop_assert!(at >= full, "{at} before {full}");
            prop_assert!(at - full <= slack, "{at} late by more than a slack after {full}");
            prop_assert!(at == current || at == full + slack, "{at}: kept or moved a slack on");
        }
    }

    #[test]
    fn fields_must_be_finite_numbers() {
        assert_eq!(parse_field(b"1.5"), Some(1.5));
        assert_eq!(parse_field(b" 7 "), Some(7.0));
        // Redis 7.0 writes a script's numbers with 17 significant digits.
        assert_eq!(
            parse_field(b"1764441000.1234560013"),
            Some(1_764_441_000.0 + 123_456.0 / 1e6)
        );
        for bad in [
            &b""[..],
            b"abc",
            b"nan",
            b"inf",
            b"-inf",
            b"1e999",
            b"\xff",
            b"1,5",
            b"0x",
            b"0x1p",
            b"1x1",
            b"\x005",
            b"0x1p99999",
        ] {
            assert_eq!(parse_field(bad), None, "{bad:?}");
        }
        // As Lua's tonumber reads them (the review's values): hexadecimal, any C blank
        // around, up to a NUL.
        for (text, value) in [
            (&b"0x10"[..], 16.0),
            (b"0X10", 16.0),
            (b"0x1p4", 16.0),
            (b" 0x10", 16.0),
            (b"-0x10", -16.0),
            (b"0x1.8p1", 3.0),
            (b"\x0b5", 5.0),
            (b"5\x0b", 5.0),
            (b"\x0c7\r", 7.0),
            (b"1.5\0abc", 1.5),
            (b" 2\0", 2.0),
        ] {
            assert_eq!(parse_field(text), Some(value), "{text:?}");
        }
        assert_eq!(parse_state(Some(b"1"), None), None);
        assert_eq!(parse_state(Some(b"x"), Some(b"1")), None);
        assert_eq!(
            parse_state(Some(b"1"), Some(b"2")),
            Some(State {
                tokens: 1.0,
                ts: 2.0
            })
        );
    }

    proptest! {
        /// Whatever the stored fields, the clock and the (validated) limits, the result
        /// is finite, never exceeds count, and a refusal spends nothing.
        #[test]
        fn take_is_total_and_sound(
            count in 1u64..=(1u64 << 53),
            period in 1e-6f64..=1e10,
            cost in 1u64..=u64::MAX >> 1,
            tokens in proptest::num::f64::NORMAL | proptest::num::f64::ZERO,
            ts in proptest::num::f64::NORMAL | proptest::num::f64::ZERO,
            stored in any::<bool>(),
            now in 0.0f64..4e9,
        ) {
            let (count, cost) = (count as f64, cost as i64);
            let state = stored.then_some(State { tokens, ts });
            let t = take(Limit { count, period }, cost, state, now);
            prop_assert!(t.state.tokens.is_finite());
            prop_assert!(t.state.tokens <= count);
            prop_assert!(t.state.ts >= now);
            let v = t.verdict;
            if v.allowed {
                prop_assert_eq!(v.retry_after, 0);
            } else if cost > count as i64 {
                prop_assert_eq!(v.retry_after, -1);
            } else {
                prop_assert!(v.retry_after >= 0);
                let before = take(Limit { count, period }, 0, state, now);
                prop_assert_eq!(before.state.tokens, t.state.tokens);
            }
        }

        /// Spending in one call or refilling for elapsed time never yields more than
        /// count + elapsed * rate tokens in total.
        #[test]
        fn never_more_than_the_refill_allows(
            count in 1u64..1000,
            period in 0.01f64..1000.0,
            steps in proptest::collection::vec((0.0f64..5.0, 1u64..5), 1..60),
        ) {
            let limit = Limit { count: count as f64, period };
            let mut now = NOW;
            let mut state = None;
            let mut spent = 0.0;
            for (dt, cost) in steps {
                now += dt;
                let t = take(limit, cost as i64, state, now);
                if t.verdict.allowed {
                    spent += cost as f64;
                }
                state = Some(t.state);
            }
            let budget = limit.count + (now - NOW) * limit.count / period;
            prop_assert!(spent <= budget + 1e-6, "spent {} budget {}", spent, budget);
        }
    }

    #[test]
    fn take_and_take2_take_wait_but_peek_does_not() {
        let t = parse(|l| parse_take(l, true), "TAKE k 10 1 WAIT 250 COST 2").unwrap();
        assert_eq!((t.cost, t.wait), (2, Some(250)));
        let t = parse(
            |l| parse_take(l, true),
            "TAKE k 10 1 ID r KEEP 5 COST 2 WAIT 0",
        )
        .unwrap();
        assert_eq!(t.wait, Some(0));
        assert_eq!(
            parse(|l| parse_take(l, true), "TAKE k 10 1").unwrap().wait,
            None
        );
        let p = parse(|l| parse_take_pair(l), "TAKE2 c 10 1 k 60 60 WAIT 60000").unwrap();
        assert_eq!((p.client.wait, p.key.wait), (Some(60_000), Some(60_000)));
        for (words, error) in [
            (
                "TAKE k 10 1 WAIT",
                "ERR WAIT needs a number of milliseconds",
            ),
            (
                "TAKE k 10 1 WAIT -1",
                "ERR WAIT must be an integer from 0 to 60000",
            ),
            (
                "TAKE k 10 1 WAIT 1.5",
                "ERR WAIT must be an integer from 0 to 60000",
            ),
            (
                "TAKE k 10 1 WAIT 60001",
                "ERR WAIT must be an integer from 0 to 60000",
            ),
            ("TAKE k 10 1 WAIT 5 WAIT 5", "ERR WAIT given more than once"),
        ] {
            assert_eq!(
                parse(|l| parse_take(l, true), words).err().as_deref(),
                Some(error),
                "{words}"
            );
        }
        assert_eq!(
            parse(|l| parse_take(l, false), "PEEK k 10 1 WAIT 5")
                .err()
                .as_deref(),
            Some("ERR syntax error: expected COST n")
        );
    }

    #[test]
    fn waiters_are_charged_at_arrival_and_served_in_order() {
        let ten_a_second = limit(10.0, 1.0);
        let empty = Some(State {
            tokens: 0.0,
            ts: NOW,
        });
        // Fits now: a plain take.
        let full = take_waiting(ten_a_second, 1, None, NOW, 500);
        assert_eq!(full, Waiting::Now(take(ten_a_second, 1, None, NOW)));
        // Empty: the first waiter's token refills in 0.1 s, the next one's 0.1 s later.
        let Waiting::Later { state, wait_micros } = take_waiting(ten_a_second, 1, empty, NOW, 500)
        else {
            panic!("waits");
        };
        assert_eq!((state.tokens, state.ts, wait_micros), (-1.0, NOW, 100_000));
        let Waiting::Later { state, wait_micros } =
            take_waiting(ten_a_second, 1, Some(state), NOW, 500)
        else {
            panic!("waits");
        };
        assert_eq!((state.tokens, wait_micros), (-2.0, 200_000));
        // A later caller that does not wait is refused until every waiter's token is
        // there, and told when its own will be.
        let plain = take(ten_a_second, 1, Some(state), NOW + 0.15);
        assert!(!plain.verdict.allowed);
        assert_eq!(plain.verdict.as_reply(), [0, 0, 1]);
        // A wait that does not fit: refused at once, charging nothing, as without WAIT.
        let short = take_waiting(ten_a_second, 1, Some(state), NOW, 250);
        assert_eq!(short, Waiting::Now(take(ten_a_second, 1, Some(state), NOW)));
        // A cost above the count never waits.
        let never = take_waiting(ten_a_second, 11, empty, NOW, 60_000);
        assert_eq!(never, Waiting::Now(take(ten_a_second, 11, empty, NOW)));
        // A stored time ahead: the refill starts there.
        let ahead = Some(State {
            tokens: 0.0,
            ts: NOW + 0.5,
        });
        let Waiting::Later { wait_micros, .. } = take_waiting(ten_a_second, 1, ahead, NOW, 1000)
        else {
            panic!("waits");
        };
        assert_eq!(wait_micros, 600_000);
    }

    #[test]
    fn a_waiter_that_leaves_gives_its_cost_back_and_later_ones_come_sooner() {
        let ten_a_second = limit(10.0, 1.0);
        let owed = Some(State {
            tokens: -3.0,
            ts: NOW,
        });
        let back = refund(ten_a_second, 2, owed, NOW + 0.125);
        // Refilled by 1.25 to -1.75, then two given back: later waiters 0.2 s sooner.
        assert_eq!(
            (back.state.map(|s| s.tokens), back.given),
            (Some(0.25), 2.0)
        );
        assert_eq!(refill_micros(ten_a_second, back.given), 200_000);
        // Never above the count: what the cap kept is all that comes sooner.
        let back = refund(
            ten_a_second,
            5,
            Some(State {
                tokens: 8.0,
                ts: NOW,
            }),
            NOW,
        );
        assert_eq!(
            (back.state.map(|s| s.tokens), back.given),
            (Some(10.0), 2.0)
        );
        // A missing bucket is full: nothing to write, nobody sooner.
        assert_eq!(refund(ten_a_second, 5, None, NOW).given, 0.0);
    }

    #[test]
    fn a_bucket_charged_ahead_lives_until_full_and_answers_none_left() {
        let l = limit(10.0, 1.0);
        assert_eq!(l.ttl_seconds(4.0), 1.0);
        assert_eq!(l.ttl_seconds(-5.0), 1.5);
        assert_eq!(l.ttl_seconds(-1e12), 61.0, "at most a longest wait more");
        let owed = State {
            tokens: -5.0,
            ts: 1_000.0,
        };
        assert_eq!(
            full_at_millis(1_000_000_000, owed.ts, l.ttl_seconds(owed.tokens)),
            1_002_000
        );
        assert_eq!(
            take(l, 1, Some(owed), 1_000.0).verdict.as_reply(),
            [0, 0, 1]
        );
        assert_eq!(refund(l, 2, Some(owed), 1_000.0).tokens_left, 0);
        // Fewer tokens than any waiter can owe came from no waiter: read as full.
        let deepest = -(10.0 + 10.0 * 60.0);
        let ok = State {
            tokens: deepest,
            ts: NOW,
        };
        assert_eq!(trusted(Some(ok), l, NOW), Some(ok));
        let stray = State {
            tokens: deepest - 1.0,
            ts: NOW,
        };
        assert_eq!(trusted(Some(stray), l, NOW), None);
    }

    proptest! {
        #[test]
        fn waits_never_grant_more_than_the_refill_and_keep_their_order(
            count in 1u32..50,
            period in 0.01f64..10.0,
            costs in proptest::collection::vec(1i64..5, 1..40),
            wait_ms in 0i64..60_000,
        ) {
            let l = limit(f64::from(count), period);
            let mut stored = None;
            let mut last_ready = 0i64;
            let mut granted = 0i64;
            for cost in costs {
                match take_waiting(l, cost, stored, NOW, wait_ms) {
                    Waiting::Now(t) => {
                        stored = Some(t.state);
                        if t.verdict.allowed {
                            granted += cost;
                            prop_assert!(last_ready == 0, "nobody overtakes a waiter");
                        }
                    }
                    Waiting::Later { state, wait_micros } => {
                        prop_assert!(wait_micros <= wait_ms * 1000);
                        prop_assert!(wait_micros >= last_ready, "served in arrival order");
                        last_ready = wait_micros;
                        stored = Some(state);
                        granted += cost;
                        // By its time, no more than the count and the refill were granted.
                        let allowed = f64::from(count) + wait_micros as f64 / 1e6 * l.rate();
                        prop_assert!(granted as f64 <= allowed + 1e-6);
                    }
                }
            }
        }
    }

    #[test]
    fn refund_arguments() {
        let r = parse(|l| parse_refund(l), "REFUND k 60 60 2").unwrap();
        assert_eq!((r.key, r.limit, r.amount), (1, limit(60.0, 60.0), 2));
        for (words, error) in [
            ("REFUND k 60 60", "ERR wrong number of arguments"),
            (
                "REFUND k 60 60 1 1",
                "ERR syntax error: expected ID request-id",
            ),
            ("REFUND k 60 60 1 ID", "ERR wrong number of arguments"),
            (
                "REFUND k 60 60 1 ID a b",
                "ERR syntax error: expected ID request-id",
            ),
            (
                "REFUND k 60 60 1 ID a KEEP 5 c",
                "ERR wrong number of arguments",
            ),
            (
                "REFUND k 60 60 0",
                "ERR n must be an integer from 1 to 9223372036854775807",
            ),
            (
                "REFUND k 60 60 1.5",
                "ERR n must be an integer from 1 to 9223372036854775807",
            ),
            (
                "REFUND k 0 60 1",
                "ERR count must be an integer from 1 to 9007199254740992",
            ),
        ] {
            let got = parse(|l| parse_refund(l), words).unwrap_err();
            assert!(got.starts_with(error), "{words}: {got}");
        }
    }

    #[test]
    fn a_refund_refills_to_now_then_adds_never_above_the_count() {
        let five = limit(5.0, 60.0);
        // Spent to 0 at NOW - 12: 1 token refilled by now, 2 given back.
        let spent = Some(State {
            tokens: 0.0,
            ts: NOW - 12.0,
        });
        let r = refund(five, 2, spent, NOW);
        assert_eq!(
            r.state,
            Some(State {
                tokens: 3.0,
                ts: NOW
            })
        );
        assert_eq!(r.tokens_left, 3);
        // Never above the count.
        let r = refund(five, 1_000, spent, NOW);
        assert_eq!(
            r.state,
            Some(State {
                tokens: 5.0,
                ts: NOW
            })
        );
        // A missing bucket is full: nothing to write.
        assert_eq!(
            refund(five, 2, None, NOW),
            Refund {
                state: None,
                tokens_left: 5,
                given: 0.0,
            }
        );
        // A stored time ahead of the clock stays: no credit for a clock stepped back.
        let ahead = Some(State {
            tokens: 1.0,
            ts: NOW + 30.0,
        });
        let r = refund(five, 1, ahead, NOW);
        assert_eq!(
            r.state,
            Some(State {
                tokens: 2.0,
                ts: NOW + 30.0
            })
        );
    }

    proptest! {
        /// A take then a refund of its cost leaves the bucket as a take of nothing would:
        /// no credit minted or lost.
        #[test]
        fn a_refund_undoes_a_take(
            count in 1u32..1000, period in 0.5f64..7200.0,
            tokens in 0.0f64..1000.0, age in 0.0f64..10_000.0, cost in 1i64..1000,
        ) {
            let bucket = limit(count as f64, period);
            let stored = Some(State { tokens: tokens.min(count as f64), ts: NOW - age });
            let taken = take(bucket, cost, stored, NOW);
            prop_assume!(taken.verdict.allowed);
            let back = refund(bucket, cost, Some(taken.state), NOW);
            let untouched = take(bucket, 0, stored, NOW).state;
            let state = back.state.unwrap();
            prop_assert_eq!(state.ts, untouched.ts);
            prop_assert!((state.tokens - untouched.tokens).abs() < 1e-9);
        }
    }
}
