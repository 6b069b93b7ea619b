//! Calendar quotas: calls and rows counted per day or per month in a caller's time
//! zone, following that zone's rules (daylight-saving changes included) from the
//! bundled IANA database, so a server without a zone database still works.

use std::cell::RefCell;
use std::io::Write;

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{Timestamp, ZonedDateTime};

use crate::args::{set_once, ArgError, ArgList, Args};
use crate::number::stored_count;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Per {
    Day,
    Month,
}

/// A period's label, `2026-11` for a month or `2026-11-29` for a day, kept on the stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Label {
    bytes: [u8; 16],
    len: usize,
}

impl Label {
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    pub fn as_str(&self) -> &str {
        // Only ASCII digits and dashes are ever written.
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }
}

/// The current period in a zone: its label, and its end (the next period's first
/// instant) in Unix seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Period {
    pub label: Label,
    pub start: i64,
    pub end: i64,
}

impl Period {
    /// The key's expiry: a day after the period ends, so old callers clean themselves up.
    pub fn expire_at_millis(&self) -> i64 {
        (self.end + 86_400) * 1000
    }
}

/// How many zones, and periods of each kind, the memos below keep: a server sees a
/// handful of zones; more than this only costs the lookups again.
const MEMO_SIZE: usize = 16;

thread_local! {
    /// Zones by the name a call gave, as the database resolved it.
    static ZONES: RefCell<Vec<(Box<[u8]>, TimeZone)>> = const { RefCell::new(Vec::new()) };
    /// The periods computed last, by kind and zone name.
    static PERIODS: RefCell<Vec<(Per, Box<str>, Period)>> = const { RefCell::new(Vec::new()) };
}

/// Keeps `entry` in `memo`, dropping its oldest entry when full.
fn remember<T>(memo: &mut Vec<T>, entry: T) {
    if memo.len() == MEMO_SIZE {
        memo.remove(0);
    }
    memo.push(entry);
}

/// The period containing `now_micros` in `zone`; None only for a clock outside the
/// calendar's range (years beyond ±9999).
///
/// Periods are computed once per zone, kind and period: a clock still within the one
/// computed last for them gets it back without the zone arithmetic (periods of one
/// kind split the timeline, so the one containing the clock is that one). Zones are
/// told apart by their database name: the bundled database's rules for a name are
/// fixed.
pub fn period(per: Per, zone: &TimeZone, now_micros: i64) -> Option<Period> {
    let within = |p: &Period| {
        p.start.saturating_mul(1_000_000) <= now_micros
            && now_micros < p.end.saturating_mul(1_000_000)
    };
    let name = zone.iana_name();
    if let Some(name) = name {
        let found = PERIODS.with_borrow(|memo| {
            memo.iter()
                .find(|(p, n, period)| *p == per && **n == *name && within(period))
                .map(|(_, _, period)| *period)
        });
        if found.is_some() {
            return found;
        }
    }
    let period = compute_period(per, zone, now_micros)?;
    if let Some(name) = name {
        PERIODS.with_borrow_mut(|memo| {
            memo.retain(|(p, n, _)| !(*p == per && **n == *name));
            remember(memo, (per, name.into(), period));
        });
    }
    Some(period)
}

/// `period`, computed.
fn compute_period(per: Per, zone: &TimeZone, now_micros: i64) -> Option<Period> {
    let now = ZonedDateTime::new(Timestamp::from_microsecond(now_micros).ok()?, zone.clone());
    period_of_day(per, zone, now.date())
}

/// The period a call counts into: the one the clock is in, unless the key holds the
/// next period of the same kind. That happens when the clock stepped back across a
/// period's start (a failover to a primary whose clock is behind): the next period's
/// counts are kept and counted into, never reset to an earlier period's. A stored
/// earlier, unreadable, or later than next period (a clock stepped far forward, a stray
/// write: no clock about to enter it wrote it) starts afresh in the clock's period, so
/// it locks a quota at most until the clock's period ends.
pub fn counting_period(
    per: Per,
    zone: &TimeZone,
    now_micros: i64,
    stored_label: Option<&[u8]>,
) -> Option<Period> {
    let current = period(per, zone, now_micros)?;
    if stored_label == Some(current.label.as_bytes()) {
        return Some(current);
    }
    let stored = stored_label
        .and_then(|label| first_day_of_label(per, label))
        .and_then(|day| period_of_day(per, zone, day));
    Some(match stored {
        Some(next) if next.start == current.end => next,
        _ => current,
    })
}

/// The first day of the period a label names: `YYYY-MM-DD` for a day, `YYYY-MM` for a
/// month, as `period` writes them; None for anything else.
fn first_day_of_label(per: Per, label: &[u8]) -> Option<Date> {
    let number = |digits: &[u8]| -> Option<i16> {
        digits.iter().try_fold(0i16, |n, &d| {
            d.is_ascii_digit().then(|| n * 10 + i16::from(d - b'0'))
        })
    };
    let (year, month, day) = match (per, label) {
        (Per::Day, [y @ .., b'-', m1, m2, b'-', d1, d2]) if y.len() == 4 => {
            (number(y)?, number(&[*m1, *m2])?, number(&[*d1, *d2])?)
        }
        (Per::Month, [y @ .., b'-', m1, m2]) if y.len() == 4 => {
            (number(y)?, number(&[*m1, *m2])?, 1)
        }
        _ => return None,
    };
    Date::new(year, i8::try_from(month).ok()?, i8::try_from(day).ok()?).ok()
}

/// The period of kind `per` that contains `day` in `zone`.
fn period_of_day(per: Per, zone: &TimeZone, today: Date) -> Option<Period> {
    let (first_day, next_first_day) = match per {
        Per::Day => (today, today.tomorrow().ok()?),
        Per::Month => (
            today.first_of_month(),
            today.last_of_month().tomorrow().ok()?,
        ),
    };
    // A day starts at its first instant: midnight, or the end of a DST gap at midnight.
    let start = first_day.to_zoned_datetime(zone.clone()).ok()?.timestamp();
    let end = next_first_day
        .to_zoned_datetime(zone.clone())
        .ok()?
        .timestamp();
    let mut label = Label {
        bytes: [0; 16],
        len: 0,
    };
    let mut out = &mut label.bytes[..];
    let written = match per {
        Per::Day => write!(
            out,
            "{:04}-{:02}-{:02}",
            today.year(),
            today.month(),
            today.day()
        ),
        Per::Month => write!(out, "{:04}-{:02}", today.year(), today.month()),
    };
    written.ok()?;
    label.len = 16 - out.len();
    Some(Period {
        label,
        start: start.as_second(),
        end: end.as_second(),
    })
}

/// A zone by its IANA name (e.g. `Europe/Berlin`, `UTC`), from the bundled database;
/// the names found are kept, so a name is looked up once.
pub fn zone(name: &[u8]) -> Result<TimeZone, ArgError> {
    let known = ZONES.with_borrow(|memo| {
        memo.iter()
            .find(|(n, _)| **n == *name)
            .map(|(_, zone)| zone.clone())
    });
    if let Some(zone) = known {
        return Ok(zone);
    }
    let error = ArgError::Text {
        name: "TZ",
        rule: "a known IANA time zone name, e.g. Europe/Berlin or UTC",
    };
    let text = std::str::from_utf8(name).map_err(|_| error.clone())?;
    let zone = jiff::tz::db().get(text).map_err(|_| error)?;
    ZONES.with_borrow_mut(|memo| remember(memo, (name.into(), zone.clone())));
    Ok(zone)
}

/// Calls and rows counted in the current period.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub calls: i64,
    pub rows: i64,
}

/// The usage the hash holds for `period`; zero when it holds another period's.
pub fn usage(
    stored_period: Option<&[u8]>,
    calls: Option<&[u8]>,
    rows: Option<&[u8]>,
    period: &Period,
) -> Usage {
    if stored_period != Some(period.label.as_bytes()) {
        return Usage::default();
    }
    Usage {
        calls: stored_count(calls),
        rows: stored_count(rows),
    }
}

/// QAG.QUOTA's verdict: allowed while every given count is below its limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Check {
    pub allowed: bool,
    pub calls_remaining: Option<i64>,
    pub rows_remaining: Option<i64>,
}

pub fn check(usage: Usage, limits: Limits) -> Check {
    let remaining = |used: i64, limit: Option<i64>| limit.map(|l| (l - used).max(0));
    let below = |used: i64, limit: Option<i64>| limit.is_none_or(|l| used < l);
    Check {
        allowed: below(usage.calls, limits.calls) && below(usage.rows, limits.rows),
        calls_remaining: remaining(usage.calls, limits.calls),
        rows_remaining: remaining(usage.rows, limits.rows),
    }
}

/// Adds a call's counts; None when a count would overflow.
pub fn add(usage: Usage, counts: Usage) -> Option<Usage> {
    Some(Usage {
        calls: usage.calls.checked_add(counts.calls)?,
        rows: usage.rows.checked_add(counts.rows)?,
    })
}

/// Seeds from the gateway's durable store: each count becomes the larger of the two, so
/// a seed never lowers a count nor loses calls made meanwhile.
pub fn seed(usage: Usage, counts: Usage) -> Usage {
    Usage {
        calls: usage.calls.max(counts.calls),
        rows: usage.rows.max(counts.rows),
    }
}

/// The usage to write after an ADD or a SEED turned `before` (the period's, zero when
/// the key holds another period or none) into `after`; None when no count changed (an
/// ADD of nothing, a SEED at or below the counts): then nothing is written, replicated
/// or signalled, as a plain command that changes nothing.
pub fn to_write(before: Usage, after: Usage) -> Option<Usage> {
    (after != before).then_some(after)
}

/// The CALLS and ROWS limits of a check; None where not limited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub calls: Option<i64>,
    pub rows: Option<i64>,
}

/// The arguments every quota command shares: `key PER day|month TZ zone`, then CALLS
/// and ROWS (limits for QAG.QUOTA, counts for ADD and SEED), options in any order.
#[derive(Clone, Debug)]
pub struct QuotaArgs {
    pub key: usize,
    pub per: Per,
    pub zone: TimeZone,
    pub calls: Option<i64>,
    pub rows: Option<i64>,
    /// The argument holding the request id, when given (QAG.QUOTA.ADD only).
    pub id: Option<crate::replay::IdArg>,
}

impl QuotaArgs {
    /// The counts of ADD or SEED; a missing one adds nothing.
    pub fn counts(&self) -> Usage {
        Usage {
            calls: self.calls.unwrap_or(0),
            rows: self.rows.unwrap_or(0),
        }
    }

    pub fn limits(&self) -> Limits {
        Limits {
            calls: self.calls,
            rows: self.rows,
        }
    }
}

/// A quota command's arguments; `ids` for QAG.QUOTA.ADD, which also takes
/// `ID request-id`.
pub fn parse_quota<L: ArgList + ?Sized>(list: &L, ids: bool) -> Result<QuotaArgs, ArgError> {
    let mut args = Args::new(list);
    args.expect_count(5, 13)?;
    let key = args.key()?;
    let (mut per, mut zone, mut calls, mut rows, mut id) = (None, None, None, None, None);
    let (options, expected): (&[&str], _) = match ids {
        true => (
            &["PER", "TZ", "CALLS", "ROWS", "ID"],
            "PER, TZ, CALLS, ROWS or ID",
        ),
        false => (&["PER", "TZ", "CALLS", "ROWS"], "PER, TZ, CALLS or ROWS"),
    };
    while let Some(option) = args.option(options, expected)? {
        match option {
            0 => {
                let index = args.string()?;
                let value = match args.bytes(index) {
                    v if v.eq_ignore_ascii_case(b"day") => Per::Day,
                    v if v.eq_ignore_ascii_case(b"month") => Per::Month,
                    _ => {
                        return Err(ArgError::Text {
                            name: "PER",
                            rule: "day or month",
                        })
                    }
                };
                set_once(&mut per, value, "PER")?;
            }
            1 => {
                let index = args.string()?;
                set_once(&mut zone, self::zone(args.bytes(index))?, "TZ")?;
            }
            2 => set_once(&mut calls, args.integer("CALLS", 0, i64::MAX)?, "CALLS")?,
            3 => set_once(&mut rows, args.integer("ROWS", 0, i64::MAX)?, "ROWS")?,
            _ => set_once(&mut id, crate::replay::parse_id(&mut args)?, "ID")?,
        }
    }
    let (Some(per), Some(zone)) = (per, zone) else {
        return Err(ArgError::Invalid("missing PER day|month and TZ zone"));
    };
    if calls.is_none() && rows.is_none() {
        return Err(ArgError::Invalid("missing CALLS or ROWS"));
    }
    Ok(QuotaArgs {
        key,
        per,
        zone,
        calls,
        rows,
        id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use jiff::civil::date;

    fn micros(zone: &str, y: i16, m: i8, d: i8, h: i8, min: i8) -> i64 {
        let tz = jiff::tz::db().get(zone).unwrap();
        date(y, m, d)
            .at(h, min, 0, 0)
            .to_zoned_datetime(tz)
            .unwrap()
            .timestamp()
            .as_microsecond()
    }

    fn at(per: Per, zone: &str, y: i16, m: i8, d: i8, h: i8, min: i8) -> Period {
        let tz = jiff::tz::db().get(zone).unwrap();
        period(per, &tz, micros(zone, y, m, d, h, min)).unwrap()
    }

    fn utc(y: i16, m: i8, d: i8, h: i8) -> i64 {
        micros("UTC", y, m, d, h, 0) / 1_000_000
    }

    #[test]
    fn months_and_days_in_utc() {
        let p = at(Per::Month, "UTC", 2026, 11, 29, 13, 5);
        assert_eq!(p.label.as_str(), "2026-11");
        assert_eq!((p.start, p.end), (utc(2026, 11, 1, 0), utc(2026, 12, 1, 0)));
        let p = at(Per::Day, "UTC", 2026, 11, 29, 13, 5);
        assert_eq!(p.label.as_str(), "2026-11-29");
        assert_eq!(p.end - p.start, 86_400);
        assert_eq!(p.expire_at_millis(), (utc(2026, 11, 30, 0) + 86_400) * 1000);
    }

    #[test]
    fn year_ends_and_leap_years() {
        let p = at(Per::Month, "UTC", 2026, 12, 31, 23, 59);
        assert_eq!((p.label.as_str(), p.end), ("2026-12", utc(2027, 1, 1, 0)));
        let p = at(Per::Month, "UTC", 2028, 2, 10, 0, 0);
        assert_eq!(p.end - p.start, 29 * 86_400, "February of a leap year");
        let p = at(Per::Month, "UTC", 2027, 2, 10, 0, 0);
        assert_eq!(p.end - p.start, 28 * 86_400);
        let p = at(Per::Day, "UTC", 2028, 2, 28, 12, 0);
        assert_eq!(p.end, utc(2028, 2, 29, 0));
    }

    #[test]
    fn boundaries_belong_to_the_period_they_start() {
        let tz = jiff::tz::db().get("UTC").unwrap();
        let boundary = utc(2026, 12, 1, 0) * 1_000_000;
        assert_eq!(
            period(Per::Month, &tz, boundary).unwrap().label.as_str(),
            "2026-12"
        );
        assert_eq!(
            period(Per::Month, &tz, boundary - 1)
                .unwrap()
                .label
                .as_str(),
            "2026-11"
        );
    }

    #[test]
    fn daylight_saving_days_of_23_and_25_hours() {
        // Europe/Berlin: clocks go forward on 2026-03-29 and back on 2026-10-25.
        let p = at(Per::Day, "Europe/Berlin", 2026, 3, 29, 12, 0);
        assert_eq!(
            (p.label.as_str(), p.end - p.start),
            ("2026-03-29", 23 * 3600)
        );
        let p = at(Per::Day, "Europe/Berlin", 2026, 10, 25, 12, 0);
        assert_eq!(
            (p.label.as_str(), p.end - p.start),
            ("2026-10-25", 25 * 3600)
        );
        // America/New_York: 2026-03-08 and 2026-11-01.
        let p = at(Per::Day, "America/New_York", 2026, 3, 8, 12, 0);
        assert_eq!(p.end - p.start, 23 * 3600);
        let p = at(Per::Day, "America/New_York", 2026, 11, 1, 12, 0);
        assert_eq!(p.end - p.start, 25 * 3600);
        // The month that holds the change is an hour short.
        let p = at(Per::Month, "Europe/Berlin", 2026, 3, 15, 0, 0);
        assert_eq!(p.end - p.start, 31 * 86_400 - 3600);
    }

    #[test]
    fn the_zone_decides_the_day() {
        // 23:30 UTC on 2026-11-29 is already the 30th in Berlin, still the 29th in New York.
        let now = micros("UTC", 2026, 11, 29, 23, 30);
        let berlin = jiff::tz::db().get("Europe/Berlin").unwrap();
        let new_york = jiff::tz::db().get("America/New_York").unwrap();
        assert_eq!(
            period(Per::Day, &berlin, now).unwrap().label.as_str(),
            "2026-11-30"
        );
        assert_eq!(
            period(Per::Day, &new_york, now).unwrap().label.as_str(),
            "2026-11-29"
        );
        let p = period(Per::Month, &berlin, micros("UTC", 2026, 11, 30, 23, 30)).unwrap();
        assert_eq!(p.label.as_str(), "2026-12", "already December in Berlin");
    }

    #[test]
    fn a_stored_later_period_is_counted_into_never_an_earlier_one() {
        let berlin = jiff::tz::db().get("Europe/Berlin").unwrap();
        // The clock says 23:59 on 2026-11-30 in Berlin; the key already holds December.
        let now = micros("Europe/Berlin", 2026, 11, 30, 23, 59);
        let p = counting_period(Per::Month, &berlin, now, Some(b"2026-12")).unwrap();
        assert_eq!(
            p,
            period(Per::Month, &berlin, micros("UTC", 2026, 12, 15, 0, 0)).unwrap()
        );
        assert_eq!(p.end, micros("Europe/Berlin", 2027, 1, 1, 0, 0) / 1_000_000);
        let p = counting_period(Per::Day, &berlin, now, Some(b"2026-12-01")).unwrap();
        assert_eq!(p.label.as_str(), "2026-12-01");
        assert_eq!(
            p.end,
            micros("Europe/Berlin", 2026, 12, 2, 0, 0) / 1_000_000
        );
        // An earlier, the same, or an unreadable label: the clock's period.
        let current = period(Per::Day, &berlin, now).unwrap();
        for stored in [
            None,
            Some(&b"2026-11-29"[..]),
            Some(b"2026-11-30"),
            Some(b"2026-12-02"),
            Some(b"2030-06-01"),
            Some(b"2026-12"),
            Some(b"2026-13-01"),
            Some(b"2026-02-30"),
            Some(b"+026-12-01"),
            Some(b"2026-12-01 "),
            Some(b"later"),
            Some(b""),
        ] {
            assert_eq!(
                counting_period(Per::Day, &berlin, now, stored),
                Some(current),
                "{stored:?}"
            );
        }
        let current = period(Per::Month, &berlin, now).unwrap();
        for stored in [
            &b"2026-10"[..],
            b"2026-11",
            b"2026-12-01",
            b"2026-1",
            // Beyond the next period: not trusted.
            b"2027-01",
            b"2030-06",
            b"9999-12",
        ] {
            assert_eq!(
                counting_period(Per::Month, &berlin, now, Some(stored)),
                Some(current),
                "{stored:?}"
            );
        }
    }

    #[test]
    fn a_day_that_starts_after_a_gap_at_midnight() {
        // America/Santiago skipped 00:00-01:00 on 2026-09-06: the day starts at 01:00.
        let p = at(Per::Day, "America/Santiago", 2026, 9, 6, 12, 0);
        assert_eq!(p.end - p.start, 23 * 3600);
    }

    #[test]
    fn zones_by_name() {
        assert!(zone(b"Europe/Berlin").is_ok());
        assert!(zone(b"UTC").is_ok());
        for bad in [&b"Mars/Olympus"[..], b"", b"\xff", b"../../etc/passwd"] {
            assert_eq!(
                zone(bad).unwrap_err().to_string(),
                "ERR TZ must be a known IANA time zone name, e.g. Europe/Berlin or UTC"
            );
        }
    }

    #[test]
    fn usage_resets_with_a_new_period() {
        let p = at(Per::Month, "UTC", 2026, 11, 29, 0, 0);
        let now = usage(Some(b"2026-11"), Some(b"7"), Some(b"900"), &p);
        assert_eq!(
            now,
            Usage {
                calls: 7,
                rows: 900
            }
        );
        assert_eq!(
            usage(Some(b"2026-10"), Some(b"7"), Some(b"900"), &p),
            Usage::default()
        );
        assert_eq!(usage(None, Some(b"7"), None, &p), Usage::default());
        assert_eq!(
            usage(Some(b"2026-11"), Some(b"x"), Some(b"-4"), &p),
            Usage::default()
        );
    }

    #[test]
    fn check_add_and_seed() {
        let limits = Limits {
            calls: Some(10),
            rows: Some(1000),
        };
        let c = check(
            Usage {
                calls: 9,
                rows: 999,
            },
            limits,
        );
        assert_eq!(
            (c.allowed, c.calls_remaining, c.rows_remaining),
            (true, Some(1), Some(1))
        );
        let c = check(Usage { calls: 10, rows: 5 }, limits);
        assert!(!c.allowed);
        let c = check(
            Usage {
                calls: 3,
                rows: 1500,
            },
            limits,
        );
        assert_eq!(
            (c.allowed, c.rows_remaining),
            (false, Some(0)),
            "never below 0"
        );
        let c = check(
            Usage {
                calls: 3,
                rows: 1500,
            },
            Limits {
                calls: Some(5),
                rows: None,
            },
        );
        assert_eq!((c.allowed, c.rows_remaining), (true, None));
        let u = add(Usage { calls: 1, rows: 2 }, Usage { calls: 1, rows: 40 }).unwrap();
        assert_eq!(u, Usage { calls: 2, rows: 42 });
        assert_eq!(
            add(
                Usage {
                    calls: i64::MAX,
                    rows: 0
                },
                Usage { calls: 1, rows: 0 }
            ),
            None
        );
        let s = seed(Usage { calls: 5, rows: 50 }, Usage { calls: 3, rows: 80 });
        assert_eq!(s, Usage { calls: 5, rows: 80 }, "never lowers a count");
        let before = Usage { calls: 5, rows: 50 };
        assert_eq!(to_write(before, s), Some(s));
        assert_eq!(
            to_write(before, seed(before, Usage { calls: 5, rows: 1 })),
            None
        );
        assert_eq!(
            to_write(before, add(before, Usage::default()).unwrap()),
            None
        );
        assert_eq!(
            to_write(Usage::default(), Usage::default()),
            None,
            "zeros on no key"
        );
    }

    fn parse(text: &str) -> Result<QuotaArgs, String> {
        let words: Vec<&[u8]> = text.split(' ').map(str::as_bytes).collect();
        parse_quota(&words[..], false).map_err(|e| e.to_string())
    }

    #[test]
    fn only_add_takes_an_id() {
        let words: Vec<&[u8]> = "ADD k PER day TZ UTC CALLS 1 ID req-9"
            .split(' ')
            .map(str::as_bytes)
            .collect();
        let id = parse_quota(&words[..], true).unwrap().id;
        assert_eq!(id.map(|id| id.index), Some(9));
        assert_eq!(parse_quota(&words[..], true).unwrap().calls, Some(1));
        assert_eq!(
            parse_quota(&words[..], false).err().map(|e| e.to_string()),
            Some("ERR syntax error: expected PER, TZ, CALLS or ROWS".to_string())
        );
        let words: Vec<&[u8]> = "ADD k PER day TZ UTC ID a CALLS 1 ID b"
            .split(' ')
            .map(str::as_bytes)
            .collect();
        assert_eq!(
            parse_quota(&words[..], true).err().map(|e| e.to_string()),
            Some("ERR ID given more than once".to_string())
        );
    }

    #[test]
    fn quota_arguments() {
        let q = parse("QUOTA k PER month TZ Europe/Berlin CALLS 100").unwrap();
        assert_eq!(
            (q.key, q.per, q.calls, q.rows),
            (1, Per::Month, Some(100), None)
        );
        let q = parse("QUOTA k rows 5 tz UTC per DAY calls 0").unwrap();
        assert_eq!((q.per, q.calls, q.rows), (Per::Day, Some(0), Some(5)));
        assert_eq!(q.counts(), Usage { calls: 0, rows: 5 });
        for (text, error) in [
            ("QUOTA k PER month TZ UTC", "ERR missing CALLS or ROWS"),
            (
                "QUOTA k PER month CALLS 1 ROWS 2",
                "ERR missing PER day|month and TZ zone",
            ),
            (
                "QUOTA k PER week TZ UTC CALLS 1",
                "ERR PER must be day or month",
            ),
            (
                "QUOTA k PER day TZ Nowhere CALLS 1",
                "ERR TZ must be a known IANA time zone name, e.g. Europe/Berlin or UTC",
            ),
            (
                "QUOTA k PER day TZ UTC CALLS -1",
                "ERR CALLS must be an integer from 0 to 9223372036854775807",
            ),
            (
                "QUOTA k PER day TZ UTC ROWS 1.5",
                "ERR ROWS must be an integer from 0 to 9223372036854775807",
            ),
            (
                "QUOTA k PER day TZ UTC CALLS 1 CALLS 2",
                "ERR CALLS given more than once",
            ),
            (
                "QUOTA k PER day TZ UTC LIMIT 1",
                "ERR syntax error: expected PER, TZ, CALLS or ROWS",
            ),
            (
                "QUOTA k PER day TZ UTC CALLS",
                "ERR wrong number of arguments",
            ),
            ("QUOTA k PER day TZ", "ERR wrong number of arguments"),
        ] {
            assert_eq!(parse(text).err().as_deref(), Some(error), "{text}");
        }
    }
}

#[cfg(test)]
mod memo_tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Calls walking the clock across days, months and daylight-saving changes in
        /// zones of all kinds: the remembered periods are the computed ones.
        #[test]
        fn remembered_periods_are_the_computed_ones(
            start in 0i64..4_000_000_000,
            steps in proptest::collection::vec((0usize..4, any::<bool>(), 0i64..400_000), 1..80),
        ) {
            let names = ["UTC", "Europe/Berlin", "America/New_York", "Pacific/Apia"];
            let mut now = start * 1_000_000;
            for (z, daily, step) in steps {
                now += step * 1_000_000 + 17;
                let tz = zone(names[z].as_bytes()).unwrap();
                prop_assert_eq!(tz.iana_name(), Some(names[z]));
                let per = if daily { Per::Day } else { Per::Month };
                prop_assert_eq!(period(per, &tz, now), compute_period(per, &tz, now));
            }
        }
    }
}
