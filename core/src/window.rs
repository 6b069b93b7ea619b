//! Sliding-window admission across a chain of scopes (organisation, team, key, ...),
//! each capped in requests and tokens per window. One counter per fixed window and
//! kind; the previous window is weighted by how much of it still lies inside the
//! trailing window.

use crate::args::{set_once, ArgError, ArgList, Args};
use crate::replay;
use smallvec::SmallVec;

pub const MAX_SCOPES: i64 = 64;
pub const DEFAULT_WINDOW_SECONDS: i64 = 60;
pub const MAX_WINDOW_SECONDS: i64 = 86_400;

/// A window length and the clock, both in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Clock {
    pub window_micros: i64,
    pub now_micros: i64,
}

impl Clock {
    pub fn new(window_seconds: i64, now_micros: i64) -> Clock {
        Clock {
            window_micros: window_seconds * 1_000_000,
            now_micros,
        }
    }

    /// The current window's number: floor(now / window).
    pub fn window(&self) -> i64 {
        self.now_micros.div_euclid(self.window_micros)
    }

    fn elapsed_in_window(&self) -> i64 {
        self.now_micros.rem_euclid(self.window_micros)
    }

    /// The previous window's weight: the share of it still inside the trailing window,
    /// 1 on a boundary, 0.5 half way through.
    pub fn previous_weight(&self) -> f64 {
        (self.window_micros - self.elapsed_in_window()) as f64 / self.window_micros as f64
    }

    /// Whole seconds left in the current window, at least 1: when the weighting next
    /// moves in the caller's favour.
    pub fn seconds_left(&self) -> i64 {
        let left = self.window_micros - self.elapsed_in_window();
        ((left + 999_999) / 1_000_000).max(1)
    }

    /// The key's expiry: the end of the next window, when this window's counts stop
    /// weighing on any estimate. It is the same for every write within a window, so
    /// only a window's first write moves (and replicates) it.
    pub fn expire_at_millis(&self) -> i64 {
        (self.window() + 2) * self.window_micros / 1000
    }

    /// The key's expiry after a write, given the one it has (-1: none): this window's
    /// (`expire_at_millis`), or the one it has when later, up to what the next window's
    /// counts give. Those counts are kept (a clock stepped back within a window: they
    /// were made a little ahead), and must last until they stop counting; an expiry
    /// later still came from no window this clock is about to enter (a clock stepped
    /// far forward, a stray write) and is brought back.
    ///
    /// `keep_until` (Unix ms; 0 for nothing) is how long the hash's other fields must
    /// last: remembered request ids, kept until then however the windows go.
    pub fn expiry_after_write(&self, current: i64, keep_until: i64) -> i64 {
        let latest = self.trusted_until().max(keep_until);
        self.expire_at_millis().max(current.min(latest))
    }

    /// The end of the window after the next (Unix ms): when the next window's counts,
    /// kept as made by a clock a little ahead, stop counting, and the latest a hold made
    /// by such a clock ends. A stored time later than this came from no window this
    /// clock is about to enter.
    pub fn trusted_until(&self) -> i64 {
        (self.window() + 3) * self.window_micros / 1000
    }

    /// When a reservation made now stops counting: at the end of the next window, when
    /// the counts it was admitted against stop counting too, or `hold_millis` from now
    /// when that is sooner, rounded up to a sixteenth of the window (so that a scope's
    /// reservations fall in a few groups: see `Holds`).
    pub fn hold_expires_at(&self, hold_millis: Option<i64>) -> i64 {
        let end_of_next = (self.window() + 2) * self.window_micros / 1000;
        let step = (self.window_micros / 16_000).max(1);
        match hold_millis {
            Some(ms) => {
                let at = self.now_micros / 1000 + ms;
                end_of_next
                    .min(at.div_euclid(step) * step + i64::from(at.rem_euclid(step) != 0) * step)
            }
            None => end_of_next,
        }
    }
}

/// A scope's limits per window; 0 means no limit of that kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub rpm: i64,
    pub tpm: i64,
}

/// A scope's counters in the current and the previous window, and the tokens its open
/// reservations hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub requests: i64,
    pub previous_requests: i64,
    pub tokens: i64,
    pub previous_tokens: i64,
    pub held: i64,
}

impl Counters {
    /// Whether setting the current counter of `kind` to `value` changes it (a missing
    /// or unreadable counter reads as 0): a write that changes nothing (a RECORD of no
    /// tokens) is not made, nor replicated or signalled.
    pub fn changes(&self, kind: Kind, value: i64) -> bool {
        match kind {
            Kind::Requests => value != self.requests,
            Kind::Tokens => value != self.tokens,
        }
    }
}

/// current + previous × weight.
pub fn estimate(current: i64, previous: i64, clock: &Clock) -> f64 {
    current as f64 + previous as f64 * clock.previous_weight()
}

/// QAG.ADMIT's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    pub admitted: bool,
    /// The 1-based index of the first refusing scope, 0 when admitted.
    pub refused_by: usize,
    pub retry_after: i64,
    /// The least over the scopes that limit requests, after this call; -1 when none does.
    pub requests_remaining: i64,
    pub tokens_remaining: i64,
}

impl Admission {
    pub fn as_reply(&self) -> [i64; 5] {
        [
            i64::from(self.admitted),
            self.refused_by as i64,
            self.retry_after,
            self.requests_remaining,
            self.tokens_remaining,
        ]
    }
}

/// Tokens counted against a scope's tpm: the estimate plus what open reservations hold.
fn tokens_counted(counters: &Counters, clock: &Clock) -> f64 {
    estimate(counters.tokens, counters.previous_tokens, clock) + counters.held as f64
}

/// Decides a request against every scope, in order: admitted only if each passes
/// (estimated requests + 1 ≤ rpm; tokens counted < tpm, or, for a reservation of
/// `reserve` tokens, tokens counted + `reserve` ≤ tpm). An admitted request adds 1 to
/// every scope's current request counter (and its reservation to every scope's holds);
/// a refused one adds nothing.
pub fn admit(scopes: &[(Limits, Counters)], clock: &Clock, reserve: i64) -> Admission {
    let refused_by = scopes
        .iter()
        .position(|(limits, counters)| {
            let requests = estimate(counters.requests, counters.previous_requests, clock);
            let tokens = tokens_counted(counters, clock);
            let tokens_refused = match reserve {
                0 => tokens >= limits.tpm as f64,
                _ => tokens + reserve as f64 > limits.tpm as f64,
            };
            (limits.rpm > 0 && requests + 1.0 > limits.rpm as f64)
                || (limits.tpm > 0 && tokens_refused)
        })
        .map_or(0, |index| index + 1);
    let admitted = refused_by == 0;
    let charged = if admitted { 1.0 } else { 0.0 };
    let least = |remaining: &mut dyn Iterator<Item = f64>| {
        remaining
            .map(|r| r.floor().max(0.0) as i64)
            .min()
            .unwrap_or(-1)
    };
    let requests_remaining =
        least(&mut scopes.iter().filter(|(l, _)| l.rpm > 0).map(|(l, c)| {
            l.rpm as f64 - estimate(c.requests, c.previous_requests, clock) - charged
        }));
    let reserved = if admitted { reserve as f64 } else { 0.0 };
    let tokens_remaining = least(
        &mut scopes
            .iter()
            .filter(|(l, _)| l.tpm > 0)
            .map(|(l, c)| l.tpm as f64 - tokens_counted(c, clock) - reserved),
    );
    Admission {
        admitted,
        refused_by,
        retry_after: if admitted { 0 } else { clock.seconds_left() },
        requests_remaining,
        tokens_remaining,
    }
}

/// A field name, `req:<n>` or `tok:<n>`, formatted on the stack.
#[derive(Clone, Copy)]
pub struct FieldName {
    bytes: [u8; 24],
    len: usize,
}

impl FieldName {
    pub fn new(kind: Kind, window: i64) -> FieldName {
        use std::io::Write;
        let mut bytes = [0u8; 24];
        let mut out = &mut bytes[..];
        // "req:" plus at most 20 characters of an i64 always fit in 24 bytes.
        let _ = write!(out, "{}:{window}", kind.prefix());
        let len = 24 - out.len();
        FieldName { bytes, len }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Requests,
    Tokens,
}

impl Kind {
    fn prefix(self) -> &'static str {
        match self {
            Kind::Requests => "req",
            Kind::Tokens => "tok",
        }
    }
}

/// Whether `field` is a counter of a window that no longer counts, or not yet and never
/// by this clock: older than the previous window, or later than the next (the next
/// window's counts are kept, made by a clock a little ahead). A write removes those.
/// Fields of other names are never touched.
pub fn is_stale(field: &[u8], clock: &Clock) -> bool {
    let number = field
        .strip_prefix(b"req:")
        .or_else(|| field.strip_prefix(b"tok:"))
        .and_then(crate::args::parse_integer);
    let window = clock.window();
    number.is_some_and(|n| n < window - 1 || n > window + 1)
}

/// The field that holds a scope's open reservations.
pub const HOLDS_FIELD: &str = "holds";

/// Tokens held until a time (Unix ms): one reservation, or every reservation of a scope
/// that stops counting then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hold {
    pub tokens: i64,
    pub until: i64,
}

/// A scope's open reservations, field `holds`: their tokens summed by the time they stop
/// counting, `<tokens> <until> ...`, earliest first. Reservations made in one window stop
/// counting together (at the end of the next), and a shorter HOLD is rounded to a
/// sixteenth of the window, so a scope has a few groups, whatever number of requests
/// hold tokens: reading and writing them is one field, and a reservation that expires
/// stops counting to the millisecond without a look through the key. A few groups are
/// kept without a heap allocation (a scope read and written on every reservation).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holds(SmallVec<[Hold; 2]>);

impl Holds {
    /// The groups stored in `bytes`; an unreadable field holds nothing.
    pub fn parse(bytes: &[u8]) -> Holds {
        let mut holds = SmallVec::new();
        let mut numbers = bytes.split(|&b| b == b' ').map(crate::args::parse_integer);
        while let Some(tokens) = numbers.next() {
            match (tokens, numbers.next()) {
                (Some(tokens), Some(Some(until))) => {
                    if tokens > 0 {
                        holds.push(Hold { tokens, until });
                    }
                }
                _ => return Holds::default(),
            }
        }
        Holds(holds)
    }

    /// Whether nothing is held (then the field is removed).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The field's text, written into `out` (a buffer the caller keeps).
    pub fn encode<'a>(&self, out: &'a mut Vec<u8>) -> &'a [u8] {
        let mut digits = itoa::Buffer::new();
        out.clear();
        for (i, hold) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(b' ');
            }
            out.extend_from_slice(digits.format(hold.tokens).as_bytes());
            out.push(b' ');
            out.extend_from_slice(digits.format(hold.until).as_bytes());
        }
        out
    }

    /// Drops the groups that do not count at `now_millis`: those that stopped counting,
    /// and those ending after `trusted_until` (`Clock::trusted_until`, made once per
    /// call), which no hold the clock trusts made (a clock stepped far forward, a stray
    /// write) and which hold nothing. Whether any were dropped.
    pub fn drop_not_counting(&mut self, now_millis: i64, trusted_until: i64) -> bool {
        let before = self.0.len();
        self.0
            .retain(|h| h.until > now_millis && h.until <= trusted_until);
        self.0.len() != before
    }

    /// The tokens held.
    pub fn tokens(&self) -> i64 {
        self.0
            .iter()
            .fold(0i64, |sum, h| sum.saturating_add(h.tokens))
    }

    /// Holds `hold` too.
    pub fn add(&mut self, hold: Hold) {
        match self.0.binary_search_by_key(&hold.until, |h| h.until) {
            Ok(i) => self.0[i].tokens = self.0[i].tokens.saturating_add(hold.tokens),
            Err(i) => self.0.insert(i, hold),
        }
    }

    /// Releases `tokens` of a reservation that holds until `until` (never more than its
    /// group holds).
    pub fn release(&mut self, until: i64, tokens: i64) {
        if let Ok(i) = self.0.binary_search_by_key(&until, |h| h.until) {
            self.0[i].tokens -= tokens.clamp(0, self.0[i].tokens);
            if self.0[i].tokens == 0 {
                self.0.remove(i);
            }
        }
    }
}

/// QAG.ADMIT numscopes key rpm tpm [key rpm tpm ...] [WINDOW seconds]
/// [RESERVE tokens] [ID request-id] [HOLD milliseconds]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdmitArgs {
    /// Each scope's key (an argument index) and limits, in the order given.
    pub scopes: Vec<(usize, Limits)>,
    pub window_seconds: i64,
    /// Tokens to hold on every scope when admitted; 0 for no reservation.
    pub reserve: i64,
    /// The argument holding the request id (required with RESERVE).
    pub id: Option<replay::IdArg>,
    /// HOLD: how long the reservation may stay open at most.
    pub hold_millis: Option<i64>,
}

/// QAG.RECORD numscopes key [key ...] tokens [WINDOW seconds] [ID request-id [PARTIAL]]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordArgs {
    pub keys: Vec<usize>,
    pub tokens: i64,
    pub window_seconds: i64,
    pub id: Option<replay::IdArg>,
    /// PARTIAL: charge now and shrink the reservation, keeping it open.
    pub partial: bool,
}

/// The longest HOLD: two of the longest windows.
pub const MAX_HOLD_MILLIS: i64 = 2 * MAX_WINDOW_SECONDS * 1000;

/// What a call's options may be: its option words, and the most arguments they take.
struct Options<'a> {
    words: &'a [&'a str],
    most: usize,
    /// What the words after a numscopes too small look like where the options should
    /// begin: for each, whether it is an integer (a scope's `rpm`, a trailing `tokens`).
    misplaced: &'a [bool],
}

/// `numscopes`, checked against the arguments that follow: `per_scope` each, then
/// `trailing`, then options. Where the options should begin, words shaped like
/// `options.misplaced` and no option word mean a numscopes too small (a misspelled
/// option is left to the options' own error).
fn scope_count<L: ArgList + ?Sized>(
    args: &mut Args<'_, L>,
    per_scope: usize,
    trailing: usize,
    options: &Options<'_>,
) -> Result<usize, ArgError> {
    let n = args.integer("numscopes", 1, MAX_SCOPES)? as usize;
    let rest = args.remaining();
    let expected = n * per_scope + trailing;
    let is_option = |word: &[u8]| {
        let word_is = |o: &&str| o.as_bytes().eq_ignore_ascii_case(word);
        options.words.iter().any(word_is)
    };
    let misplaced = args.ahead(expected).is_some_and(|word| !is_option(word))
        && options.misplaced.iter().enumerate().all(|(i, integer)| {
            let word = args.ahead(expected + i);
            word.is_some_and(|word| !integer || crate::args::parse_integer(word).is_some())
        });
    if rest < expected || rest > expected + options.most || misplaced {
        return Err(ArgError::Invalid(
            "numscopes does not match the number of arguments",
        ));
    }
    Ok(n)
}

/// Refuses a chain that names a key twice: its counters would be charged twice.
fn distinct<L: ArgList + ?Sized>(args: &Args<'_, L>, keys: &[usize]) -> Result<(), ArgError> {
    for (i, a) in keys.iter().enumerate() {
        if keys[..i].iter().any(|b| args.bytes(*a) == args.bytes(*b)) {
            return Err(ArgError::Invalid("each scope must have its own key"));
        }
    }
    Ok(())
}

pub fn parse_admit<L: ArgList + ?Sized>(list: &L) -> Result<AdmitArgs, ArgError> {
    let mut args = Args::new(list);
    args.expect_count(4, usize::MAX)?;
    let options = ["WINDOW", "RESERVE", "ID", "HOLD"];
    let shape = Options {
        words: &options,
        most: 10,
        misplaced: &[false, true, true],
    };
    let n = scope_count(&mut args, 3, 0, &shape)?;
    let mut scopes = Vec::with_capacity(n);
    for _ in 0..n {
        let key = args.key()?;
        let rpm = args.integer("rpm", 0, i64::MAX)?;
        let tpm = args.integer("tpm", 0, i64::MAX)?;
        scopes.push((key, Limits { rpm, tpm }));
    }
    let keys: Vec<usize> = scopes.iter().map(|(k, _)| *k).collect();
    distinct(&args, &keys)?;
    let (mut window, mut reserve, mut id, mut hold) = (None, None, None, None);
    let expected = "WINDOW seconds, RESERVE tokens, ID request-id or HOLD milliseconds";
    while let Some(option) = args.option(&options, expected)? {
        match option {
            0 => set_once(&mut window, window_seconds(&mut args)?, "WINDOW")?,
            1 => set_once(
                &mut reserve,
                args.integer("RESERVE", 1, i64::MAX)?,
                "RESERVE",
            )?,
            2 => set_once(&mut id, replay::parse_id(&mut args)?, "ID")?,
            _ => set_once(&mut hold, args.integer("HOLD", 1, MAX_HOLD_MILLIS)?, "HOLD")?,
        }
    }
    let reserve = reserve.unwrap_or(0);
    if reserve > 0 && id.is_none() {
        return Err(ArgError::Invalid("RESERVE needs an ID to commit it by"));
    }
    if hold.is_some() && reserve == 0 {
        return Err(ArgError::Invalid("HOLD goes with RESERVE"));
    }
    if scopes
        .iter()
        .any(|(_, limits)| limits.tpm > 0 && reserve > limits.tpm)
    {
        return Err(ArgError::Invalid(
            "RESERVE is above a scope's tpm: it could never be admitted",
        ));
    }
    Ok(AdmitArgs {
        scopes,
        window_seconds: window.unwrap_or(DEFAULT_WINDOW_SECONDS),
        reserve,
        id,
        hold_millis: hold,
    })
}

/// WINDOW's value, the word already read.
fn window_seconds<L: ArgList + ?Sized>(args: &mut Args<'_, L>) -> Result<i64, ArgError> {
    args.integer("WINDOW", 1, MAX_WINDOW_SECONDS)
}

pub fn parse_record<L: ArgList + ?Sized>(list: &L) -> Result<RecordArgs, ArgError> {
    let mut args = Args::new(list);
    args.expect_count(3, usize::MAX)?;
    let options = ["WINDOW", "ID", "PARTIAL"];
    let shape = Options {
        words: &options,
        most: 7,
        misplaced: &[true],
    };
    let n = scope_count(&mut args, 1, 1, &shape)?;
    let keys: Vec<usize> = (0..n).map(|_| args.key()).collect::<Result<_, _>>()?;
    distinct(&args, &keys)?;
    let tokens = args.integer("tokens", 0, i64::MAX)?;
    let (mut window, mut id, mut partial) = (None, None, None);
    let expected = "WINDOW seconds, ID request-id or PARTIAL";
    while let Some(option) = args.option(&options, expected)? {
        match option {
            0 => set_once(&mut window, window_seconds(&mut args)?, "WINDOW")?,
            1 => set_once(&mut id, replay::parse_id(&mut args)?, "ID")?,
            _ => set_once(&mut partial, true, "PARTIAL")?,
        }
    }
    let partial = partial.unwrap_or(false);
    if partial && id.is_none() {
        return Err(ArgError::Invalid(
            "PARTIAL needs the ID of the reservation it charges",
        ));
    }
    Ok(RecordArgs {
        keys,
        tokens,
        window_seconds: window.unwrap_or(DEFAULT_WINDOW_SECONDS),
        id,
        partial,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const W: i64 = 60;
    /// The start of window 29_407_350 of 60 s (2025-11-29T12:30:00Z).
    const START: i64 = 29_407_350 * 60 * 1_000_000;

    fn clock(offset_seconds: f64) -> Clock {
        Clock::new(W, START + (offset_seconds * 1e6) as i64)
    }

    /// Drops `holds`' groups as a call at `clock`'s time reads them.
    fn drop_not_counting(holds: &mut Holds, clock: &Clock) -> bool {
        holds.drop_not_counting(clock.now_micros / 1000, clock.trusted_until())
    }

    fn scope(rpm: i64, tpm: i64, counters: [i64; 4]) -> (Limits, Counters) {
        let [requests, previous_requests, tokens, previous_tokens] = counters;
        (
            Limits { rpm, tpm },
            Counters {
                requests,
                previous_requests,
                tokens,
                previous_tokens,
                held: 0,
            },
        )
    }

    #[test]
    fn the_previous_window_counts_in_full_at_the_boundary_and_half_at_mid_window() {
        assert_eq!(clock(0.0).previous_weight(), 1.0);
        assert_eq!(clock(30.0).previous_weight(), 0.5);
        assert_eq!(clock(45.0).previous_weight(), 0.25);
        assert_eq!(estimate(3, 10, &clock(0.0)), 13.0);
        assert_eq!(estimate(3, 10, &clock(30.0)), 8.0);
        assert_eq!(clock(0.0).window(), clock(59.999999).window());
        assert_eq!(clock(60.0).window(), clock(0.0).window() + 1);
    }

    #[test]
    fn traffic_bunched_at_the_end_of_the_previous_window_is_under_weighted() {
        // 10 requests in the last second of the previous window, rpm 10: the formula
        // weights them by the time left in the current window, not by when they came.
        let late = [0, 10, 0, 0];
        let a = admit(&[scope(10, 0, late)], &clock(1.0), 0);
        assert!(!a.admitted, "59/60 of 10 + 1 > 10");
        let a = admit(&[scope(10, 0, late)], &clock(15.0), 0);
        assert!(
            a.admitted,
            "7.5 + 1 ≤ 10 a quarter in, though all 10 came seconds ago"
        );
        assert_eq!(a.requests_remaining, 1);
    }

    #[test]
    fn admission_and_remaining() {
        let a = admit(&[scope(5, 100, [2, 0, 40, 0])], &clock(10.0), 0);
        assert_eq!(a.as_reply(), [1, 0, 0, 2, 60]);
        let a = admit(&[scope(5, 100, [4, 0, 40, 0])], &clock(10.0), 0);
        assert_eq!(a.as_reply(), [1, 0, 0, 0, 60], "the fifth of five");
        let a = admit(&[scope(5, 100, [5, 0, 40, 0])], &clock(10.0), 0);
        assert_eq!(a.as_reply(), [0, 1, 50, 0, 60], "refused; nothing charged");
        let a = admit(&[scope(0, 0, [500, 500, 500, 500])], &clock(10.0), 0);
        assert_eq!(a.as_reply(), [1, 0, 0, -1, -1], "no limits at all");
    }

    #[test]
    fn a_full_token_window_refuses() {
        let a = admit(&[scope(0, 1000, [0, 0, 1000, 0])], &clock(59.5), 0);
        assert_eq!(a.as_reply(), [0, 1, 1, -1, 0], "at least a second to retry");
        let a = admit(&[scope(0, 1000, [0, 0, 999, 0])], &clock(59.5), 0);
        assert_eq!(a.as_reply(), [1, 0, 0, -1, 1]);
    }

    #[test]
    fn the_first_refusing_scope_wins() {
        let org = scope(100, 0, [10, 0, 0, 0]);
        let team = scope(10, 0, [10, 0, 0, 0]);
        let key = scope(1, 0, [1, 0, 0, 0]);
        let a = admit(&[org, team, key], &clock(10.0), 0);
        assert_eq!((a.admitted, a.refused_by), (false, 2));
        assert_eq!(a.requests_remaining, 0);
        let a = admit(&[org, key, team], &clock(10.0), 0);
        assert_eq!(a.refused_by, 2);
        let a = admit(&[org, scope(20, 0, [10, 0, 0, 0])], &clock(10.0), 0);
        assert_eq!(
            a.as_reply(),
            [1, 0, 0, 9, -1],
            "the least remaining, after this call"
        );
    }

    #[test]
    fn field_names_and_stale_windows() {
        assert_eq!(
            FieldName::new(Kind::Requests, 29_407_350).as_bytes(),
            b"req:29407350"
        );
        assert_eq!(FieldName::new(Kind::Tokens, -1).as_bytes(), b"tok:-1");
        assert_eq!(
            FieldName::new(Kind::Tokens, i64::MIN).as_bytes(),
            b"tok:-9223372036854775808"
        );
        let c = clock(0.0);
        let n = c.window();
        let name = |kind, w| FieldName::new(kind, w).as_bytes().to_vec();
        assert!(!is_stale(&name(Kind::Requests, n), &c));
        assert!(!is_stale(&name(Kind::Tokens, n - 1), &c));
        assert!(
            !is_stale(&name(Kind::Tokens, n + 1), &c),
            "the next window's counts are kept"
        );
        assert!(
            is_stale(&name(Kind::Tokens, n + 2), &c),
            "later ones are no window this clock is about to enter"
        );
        assert!(is_stale(&name(Kind::Requests, i64::MAX), &c));
        assert!(is_stale(&name(Kind::Requests, n - 2), &c));
        assert!(is_stale(&name(Kind::Tokens, 1), &c));
        assert!(is_stale(b"req:-5", &c));
        for other in [
            &b"tokens"[..],
            b"ts",
            b"req:",
            b"req:x",
            b"reqs:1",
            b"REQ:1",
        ] {
            assert!(!is_stale(other, &c), "{other:?}");
        }
    }

    #[test]
    fn a_write_that_changes_no_counter_is_not_made() {
        let c = Counters {
            requests: 3,
            previous_requests: 9,
            tokens: 0,
            previous_tokens: 9,
            held: 0,
        };
        assert!(c.changes(Kind::Requests, 4));
        assert!(!c.changes(Kind::Requests, 3));
        assert!(!c.changes(Kind::Tokens, 0), "RECORD 0 on no counter");
        assert!(c.changes(Kind::Tokens, 1));
    }

    #[test]
    fn retry_and_expiry() {
        assert_eq!(clock(0.0).seconds_left(), 60);
        assert_eq!(clock(59.2).seconds_left(), 1);
        assert_eq!(clock(58.2).seconds_left(), 2);
        assert_eq!(clock(0.0).expire_at_millis(), START / 1000 + 120_000);
        assert_eq!(clock(59.9).expire_at_millis(), START / 1000 + 120_000);
        assert_eq!(clock(60.0).expire_at_millis(), START / 1000 + 180_000);
        // After a write: never earlier than this window's, never later than the next's.
        let c = clock(0.0);
        let (own, next) = (START / 1000 + 120_000, START / 1000 + 180_000);
        assert_eq!(c.expiry_after_write(-1, 0), own);
        assert_eq!(c.expiry_after_write(own - 1, 0), own);
        assert_eq!(c.expiry_after_write(own + 1, 0), own + 1);
        assert_eq!(c.expiry_after_write(next, 0), next);
        assert_eq!(c.expiry_after_write(next + 1, 0), next);
        assert_eq!(c.expiry_after_write(i64::MAX, 0), next);
        // Remembered ids keep the key up to when they are forgotten, no longer.
        assert_eq!(c.expiry_after_write(next + 5, next + 9), next + 5);
        assert_eq!(c.expiry_after_write(i64::MAX, next + 9), next + 9);
        // A hold lasts to the end of the next window, or HOLD from now when sooner.
        assert_eq!(c.hold_expires_at(None), own);
        assert_eq!(c.hold_expires_at(Some(3_750)), START / 1000 + 3_750);
        assert_eq!(
            c.hold_expires_at(Some(1_500)),
            START / 1000 + 3_750,
            "rounded up to a sixteenth of the window"
        );
        assert_eq!(c.hold_expires_at(Some(MAX_HOLD_MILLIS)), own);
    }

    #[test]
    fn reservations_count_what_they_hold_and_fit_up_to_the_tpm() {
        let held = |tokens, held| {
            let (limits, mut counters) = scope(0, 1000, [0, 0, tokens, 0]);
            counters.held = held;
            (limits, counters)
        };
        // 9 holds of 100: a tenth fits exactly, an eleventh does not.
        let a = admit(&[held(0, 900)], &clock(10.0), 100);
        assert_eq!(a.as_reply(), [1, 0, 0, -1, 0]);
        let a = admit(&[held(0, 1000)], &clock(10.0), 100);
        assert_eq!(a.as_reply(), [0, 1, 50, -1, 0]);
        // Committed at 40 each: 400 counted, six more of 100 fit.
        assert!(admit(&[held(400, 500)], &clock(10.0), 100).admitted);
        assert!(!admit(&[held(400, 600)], &clock(10.0), 100).admitted);
        // A plain ADMIT counts the holds too.
        assert!(!admit(&[held(0, 1000)], &clock(10.0), 0).admitted);
        assert_eq!(
            admit(&[held(0, 999)], &clock(10.0), 0).as_reply(),
            [1, 0, 0, -1, 1]
        );
        // A scope without a tpm holds nothing back.
        let (mut limits, counters) = held(0, 5000);
        limits.tpm = 0;
        assert!(admit(&[(limits, counters)], &clock(10.0), 100).admitted);
    }

    #[test]
    fn holds_are_grouped_by_when_they_stop_counting() {
        let mut holds = Holds::default();
        let mut text = Vec::new();
        let (t5, t9) = (START / 1000 + 5_000, START / 1000 + 9_000);
        assert!(holds.is_empty());
        holds.add(Hold {
            tokens: 100,
            until: t9,
        });
        holds.add(Hold {
            tokens: 40,
            until: t5,
        });
        holds.add(Hold {
            tokens: 7,
            until: t9,
        });
        let stored = format!("40 {t5} 107 {t9}");
        assert_eq!(holds.encode(&mut text), stored.as_bytes());
        assert_eq!(Holds::parse(holds.encode(&mut text)), holds);
        assert_eq!(holds.tokens(), 147);
        assert!(!drop_not_counting(&mut holds, &clock(4.999)));
        assert!(drop_not_counting(&mut holds, &clock(5.0)));
        assert_eq!(holds.tokens(), 107);
        holds.release(t9, 100);
        assert_eq!(holds.tokens(), 7);
        holds.release(t9, 1_000);
        assert_eq!(
            holds,
            Holds::default(),
            "never below 0; an empty group goes"
        );
        holds.release(1, 5);
        for bad in [&b"x"[..], b"1", b"1 2 3", b"1 2 x 4", b"-5 9", b"", b"1 2 "] {
            assert_eq!(Holds::parse(bad).tokens(), 0, "{bad:?}");
        }
        // More groups than are kept inline: every one read, and written back the same.
        let many: Vec<u8> = (1..=9)
            .flat_map(|i| format!("{i} {} ", i * 1000).into_bytes())
            .collect();
        let many = &many[..many.len() - 1];
        assert_eq!(Holds::parse(many).tokens(), 45);
        assert_eq!(Holds::parse(many).encode(&mut text), many);
    }

    #[test]
    fn holds_are_trusted_up_to_the_end_of_the_window_after_next() {
        // A hold made now ends by the end of the next window; one made in the next window
        // (a clock a little ahead, whose counts are kept too) by the end of the one after.
        for offset in [0.0, 30.0, 59.999] {
            let c = clock(offset);
            let latest = c.trusted_until();
            assert_eq!(latest, START / 1000 + 180_000);
            let ahead = Clock::new(W, c.now_micros + W * 1_000_000);
            assert!(c.hold_expires_at(None) < latest);
            assert_eq!(ahead.hold_expires_at(None), latest);
            let text = format!("5 {latest} 7 {} 11 {}", latest + 1, i64::MAX);
            let mut holds = Holds::parse(text.as_bytes());
            assert_eq!(holds.tokens(), 23);
            assert!(drop_not_counting(&mut holds, &c), "{offset}");
            assert_eq!(holds.tokens(), 5, "a later end holds nothing: {offset}");
            assert!(!drop_not_counting(&mut holds, &c), "{offset}");
        }
        // Once the clock moves into the next window, the bound moves with it.
        let mut holds = Holds::parse(format!("7 {}", START / 1000 + 180_001).as_bytes());
        assert!(!drop_not_counting(&mut holds, &clock(60.0)));
        assert_eq!(holds.tokens(), 7);
    }

    #[test]
    fn reservation_and_partial_arguments() {
        let a =
            parse_a("ADMIT 2 org 0 1000 key 5 500 RESERVE 300 ID r1 HOLD 2000 WINDOW 30").unwrap();
        assert_eq!(
            (
                a.reserve,
                a.id.map(|id| id.index),
                a.hold_millis,
                a.window_seconds
            ),
            (300, Some(11), Some(2000), 30)
        );
        let a = parse_a("ADMIT 1 k 1 1 ID r1").unwrap();
        assert_eq!((a.reserve, a.id.map(|id| id.index)), (0, Some(6)));
        let r = parse_r("RECORD 2 org key 250 ID r1 PARTIAL").unwrap();
        assert_eq!(
            (r.tokens, r.id.map(|id| id.index), r.partial),
            (250, Some(6), true)
        );
        let r = parse_r("RECORD 1 k 5 ID r KEEP 10 WINDOW 5").unwrap();
        assert_eq!(r.id.and_then(|id| id.keep_seconds), Some(10));
        let r = parse_r("RECORD 1 k 5 PARTIAL ID r1 WINDOW 5").unwrap();
        assert_eq!((r.partial, r.window_seconds), (true, 5));
        for (text, error) in [
            ("ADMIT 1 k 0 1000 RESERVE 10", "ERR RESERVE needs an ID to commit it by"),
            ("ADMIT 1 k 0 1000 ID r HOLD 5", "ERR HOLD goes with RESERVE"),
            (
                "ADMIT 2 a 0 1000 b 0 50 RESERVE 100 ID r",
                "ERR RESERVE is above a scope's tpm: it could never be admitted",
            ),
            (
                "ADMIT 1 k 0 1000 RESERVE 0 ID r",
                "ERR RESERVE must be an integer from 1 to 9223372036854775807",
            ),
            (
                "ADMIT 1 k 0 1000 RESERVE 5 ID r HOLD 0",
                "ERR HOLD must be an integer from 1 to 172800000",
            ),
            ("ADMIT 1 k 0 1000 ID a ID b", "ERR ID given more than once"),
            (
                "ADMIT 1 k 0 1000 LATER 5",
                "ERR syntax error: expected WINDOW seconds, RESERVE tokens, ID request-id or HOLD milliseconds",
            ),
            (
                "RECORD 1 k 5 PARTIAL",
                "ERR PARTIAL needs the ID of the reservation it charges",
            ),
            ("RECORD 1 k 5 PARTIAL PARTIAL ID r", "ERR PARTIAL given more than once"),
            (
                "RECORD 1 k 5 ID r WINDOW 5 PARTIAL x",
                "ERR syntax error: expected WINDOW seconds, ID request-id or PARTIAL",
            ),
            (
                "RECORD 1 k 5 ID r KEEP 9 WINDOW 5 PARTIAL x",
                "ERR numscopes does not match the number of arguments",
            ),
            // A numscopes too small: a scope's words, not options, follow the scopes.
            ("RECORD 1 a b 5", "ERR numscopes does not match the number of arguments"),
            (
                "RECORD 1 a b 5 WINDOW 60",
                "ERR numscopes does not match the number of arguments",
            ),
            (
                "ADMIT 1 a 1 1 b 2 2",
                "ERR numscopes does not match the number of arguments",
            ),
            (
                "ADMIT 1 a 1 1 b 2 2 WINDOW 5",
                "ERR numscopes does not match the number of arguments",
            ),
            // A misspelled option keeps its own error.
            (
                "ADMIT 1 a 1 1 WINDOWS 60",
                "ERR syntax error: expected WINDOW seconds, RESERVE tokens, ID request-id or HOLD milliseconds",
            ),
            (
                "RECORD 1 a 5 WINDOWS 60",
                "ERR syntax error: expected WINDOW seconds, ID request-id or PARTIAL",
            ),
        ] {
            let got = if text.starts_with("ADMIT") { parse_a(text).err() } else { parse_r(text).err() };
            assert_eq!(got.as_deref(), Some(error), "{text}");
        }
    }

    fn parse_a(text: &str) -> Result<AdmitArgs, String> {
        let words: Vec<&[u8]> = text.split(' ').map(str::as_bytes).collect();
        parse_admit(&words[..]).map_err(|e| e.to_string())
    }

    fn parse_r(text: &str) -> Result<RecordArgs, String> {
        let words: Vec<&[u8]> = text.split(' ').map(str::as_bytes).collect();
        parse_record(&words[..]).map_err(|e| e.to_string())
    }

    #[test]
    fn admit_arguments() {
        let a = parse_a("ADMIT 2 org 100 0 key 5 1000").unwrap();
        assert_eq!(
            a.scopes,
            vec![
                (2, Limits { rpm: 100, tpm: 0 }),
                (5, Limits { rpm: 5, tpm: 1000 })
            ]
        );
        assert_eq!(a.window_seconds, 60);
        assert_eq!(
            parse_a("ADMIT 1 k 1 1 window 10").unwrap().window_seconds,
            10
        );
        for (text, error) in [
            (
                "ADMIT 2 org 100 0",
                "ERR numscopes does not match the number of arguments",
            ),
            (
                "ADMIT 1 org 100 0 extra",
                "ERR syntax error: expected WINDOW seconds, RESERVE tokens, ID request-id or HOLD milliseconds",
            ),
            (
                "ADMIT 0 org 1 1",
                "ERR numscopes must be an integer from 1 to 64",
            ),
            (
                "ADMIT 65 org 1 1",
                "ERR numscopes must be an integer from 1 to 64",
            ),
            (
                "ADMIT x org 1 1",
                "ERR numscopes must be an integer from 1 to 64",
            ),
            (
                "ADMIT 1 org -1 1",
                "ERR rpm must be an integer from 0 to 9223372036854775807",
            ),
            (
                "ADMIT 1 org 1 1.5",
                "ERR tpm must be an integer from 0 to 9223372036854775807",
            ),
            (
                "ADMIT 1 org 1 1 WINDOW 0",
                "ERR WINDOW must be an integer from 1 to 86400",
            ),
            (
                "ADMIT 1 org 1 1 WINDOW 86401",
                "ERR WINDOW must be an integer from 1 to 86400",
            ),
            (
                "ADMIT 1 org 1 1 SPAN 5",
                "ERR syntax error: expected WINDOW seconds, RESERVE tokens, ID request-id or HOLD milliseconds",
            ),
            (
                "ADMIT 2 org 1 1 org 2 2",
                "ERR each scope must have its own key",
            ),
            ("ADMIT 1 org 1", "ERR wrong number of arguments"),
        ] {
            assert_eq!(parse_a(text).err().as_deref(), Some(error), "{text}");
        }
    }

    #[test]
    fn record_arguments() {
        let r = parse_r("RECORD 3 org team key 250").unwrap();
        assert_eq!(
            (r.keys, r.tokens, r.window_seconds),
            (vec![2, 3, 4], 250, 60)
        );
        assert_eq!(parse_r("RECORD 1 k 0 WINDOW 5").unwrap().window_seconds, 5);
        for (text, error) in [
            (
                "RECORD 2 org 250",
                "ERR numscopes does not match the number of arguments",
            ),
            (
                "RECORD 1 org -5",
                "ERR tokens must be an integer from 0 to 9223372036854775807",
            ),
            ("RECORD 2 org org 5", "ERR each scope must have its own key"),
            ("RECORD 1 org", "ERR wrong number of arguments"),
        ] {
            assert_eq!(parse_r(text).err().as_deref(), Some(error), "{text}");
        }
    }

    proptest! {
        /// However the counters and the clock fall, an admission is consistent: the
        /// refusing scope really fails, every scope before it passes, and remaining
        /// values are never negative.
        #[test]
        fn admission_is_consistent(
            raw in proptest::collection::vec((0i64..50, 0i64..500, 0i64..50, 0i64..50, 0i64..500, 0i64..500), 1..8),
            offset in 0.0f64..60.0,
        ) {
            let clock = clock(offset);
            let scopes: Vec<_> = raw.iter().map(|&(rpm, tpm, r, pr, t, pt)| scope(rpm, tpm, [r, pr, t, pt])).collect();
            let a = admit(&scopes, &clock, 0);
            let fails = |(l, c): &(Limits, Counters)| {
                (l.rpm > 0 && estimate(c.requests, c.previous_requests, &clock) + 1.0 > l.rpm as f64)
                    || (l.tpm > 0 && estimate(c.tokens, c.previous_tokens, &clock) >= l.tpm as f64)
            };
            if a.admitted {
                prop_assert!(scopes.iter().all(|s| !fails(s)));
                prop_assert_eq!(a.retry_after, 0);
            } else {
                prop_assert!(fails(&scopes[a.refused_by - 1]));
                prop_assert!(scopes[..a.refused_by - 1].iter().all(|s| !fails(s)));
                prop_assert!((1..=60).contains(&a.retry_after));
            }
            prop_assert!(a.requests_remaining >= -1 && a.tokens_remaining >= -1);
        }
    }
}
