//! Counting in this process's memory, for the back-off after Redis failed
//! ([`OnUnavailable::Local`](crate::OnUnavailable::Local)): token buckets (counted with
//! the module's own arithmetic), leases, quotas and sliding windows (the module's
//! arithmetic on this process's counts). Each starts from what Redis last answered for
//! its key (`saw`: the tokens left and when, the live leases, the counts, what a window
//! had left), refilled by the clock from there; only a key this process never saw
//! answered starts fresh (a full bucket, no lease, nothing counted). Every limit, and what
//! Redis said is left of it, is scaled by the process's share of it, so one process never
//! grants more than its share of what was left plus what refills, and a fleet of N
//! processes with a share of 1/N stays within the limit during an outage. Plain code: the
//! clock is an argument.

use std::collections::{HashMap, HashSet};

use crate::bounded::BoundedMap;
use qag_core::bucket::{self, Limit, State, Verdict};
use qag_core::quota::{self, Usage};
use qag_core::window::{self, Clock, Counters};

/// Keys remembered per kind (Redis's last words, local counts): past it the oldest go,
/// and a key that goes reads as never seen (see [`BoundedMap`]).
pub const KEYS_KEPT: usize = 100_000;

/// A process's part of a limit: `max(1, floor(limit × share))`.
pub fn share_of(limit: u64, share: f64) -> u64 {
    ((limit as f64 * share).floor() as u64).clamp(1, limit.max(1))
}

/// Everything one limiter counts locally. Buckets, leases and windows live through a
/// back-off and are dropped when Redis answers again; the quota counts seen from Redis
/// are kept (they are what local quota decisions start from). Each kind remembers at
/// most [`KEYS_KEPT`] keys, and no call looks at more than a few of them.
#[derive(Default)]
pub struct LocalState {
    pub buckets: LocalBuckets,
    pub leases: LocalLeases,
    pub quotas: LocalQuotas,
    pub windows: LocalWindows,
}

impl LocalState {
    /// Redis answers again: what was counted here goes (Redis's last words stay: the
    /// next outage starts from what Redis says until then).
    pub fn clear(&mut self) {
        self.buckets.clear();
        self.leases.live.clear();
        self.quotas.forget_adds();
        self.windows.scopes.clear();
    }
}

/// Buckets counted in this process (their limits this process's share). One starts from
/// Redis's last word on it ([`LocalBuckets::saw`]): that share of the tokens it said
/// were left, at the time it said so; else full.
pub struct LocalBuckets {
    buckets: BoundedMap<String, (State, Limit)>,
    /// Redis's last word on each bucket: kept through outages, never cleared.
    seen: BoundedMap<String, (State, Limit)>,
}

impl Default for LocalBuckets {
    fn default() -> LocalBuckets {
        LocalBuckets {
            buckets: BoundedMap::new(KEYS_KEPT),
            seen: BoundedMap::new(KEYS_KEPT),
        }
    }
}

/// A bucket full again says nothing a missing one would not.
fn refilled_by(now: f64) -> impl Fn(&String, &(State, Limit)) -> bool {
    move |_, (state, limit)| refilled(state, limit, now)
}

impl LocalBuckets {
    /// Redis answered that `left` whole tokens of `limit` are left at `now` (Unix s).
    pub fn saw(&mut self, key: &str, limit: Limit, left: u64, now: f64) {
        let state = State {
            tokens: left as f64,
            ts: now,
        };
        self.seen
            .insert(key.to_owned(), (state, limit), refilled_by(now));
    }

    /// The bucket as counted here, else as Redis last left it (scaled to `limit`, this
    /// process's share), else None: a missing bucket, full.
    fn stored(&self, key: &str, limit: Limit) -> Option<State> {
        if let Some((state, _)) = self.buckets.get(key) {
            return Some(*state);
        }
        let (seen, full) = self.seen.get(key)?;
        Some(State {
            tokens: (seen.tokens * limit.count / full.count).min(limit.count),
            ts: seen.ts,
        })
    }

    /// Takes `cost` from the bucket at `key`; `now` in Unix seconds.
    pub fn take(&mut self, key: &str, limit: Limit, cost: i64, now: f64) -> Verdict {
        let stored = self.stored(key, limit);
        let outcome = bucket::take(limit, cost, stored, now);
        self.buckets
            .insert(key.to_owned(), (outcome.state, limit), refilled_by(now));
        outcome.verdict
    }

    /// Gives `amount` back to the bucket at `key` (a missing one is full); the tokens
    /// left.
    pub fn refund(&mut self, key: &str, limit: Limit, amount: i64, now: f64) -> i64 {
        let stored = self.stored(key, limit);
        let refund = bucket::refund(limit, amount, stored, now);
        if let Some(state) = refund.state {
            self.buckets
                .insert(key.to_owned(), (state, limit), refilled_by(now));
        }
        refund.tokens_left
    }

    /// What `take` would answer, changing nothing.
    pub fn peek(&self, key: &str, limit: Limit, cost: i64, now: f64) -> Verdict {
        let stored = self.stored(key, limit);
        bucket::take(limit, cost, stored, now).verdict
    }

    /// Forgets what was counted here (Redis's last words stay).
    pub fn clear(&mut self) {
        self.buckets.clear();
    }

    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.len() == 0
    }
}

fn refilled(state: &State, limit: &Limit, now: f64) -> bool {
    state.tokens + (now - state.ts).max(0.0) * limit.count / limit.period >= limit.count
}

/// Live leases per key taken by this process, by id: a slot is freed only by the id
/// that holds it (a guard from an earlier outage frees nothing of a later one), and an id
/// asking again holds one slot, as the module counts it. Beside them, this process's
/// share of those Redis last said were live ([`LocalLeases::saw`]) hold slots until they
/// would have run out. Only keys with a lease held here are kept (a refusal keeps
/// nothing): they are as many as the calls in flight.
pub struct LocalLeases {
    live: HashMap<String, HashSet<String>>,
    /// key -> (live, until: Unix seconds), Redis's last word.
    seen: BoundedMap<String, (u64, f64)>,
}

impl Default for LocalLeases {
    fn default() -> LocalLeases {
        LocalLeases {
            live: HashMap::new(),
            seen: BoundedMap::new(KEYS_KEPT),
        }
    }
}

impl LocalLeases {
    /// Redis answered that `live` leases are held at `now`, each for `ttl_ms` at most
    /// from then.
    pub fn saw(&mut self, key: &str, live: u64, ttl_ms: u64, now: f64) {
        self.seen.insert(
            key.to_owned(),
            (live, now + ttl_ms as f64 / 1000.0),
            |_, (_, until)| *until <= now,
        );
    }

    /// This process's `share` of the leases Redis last said were live, while they may
    /// still be (rounded up).
    fn taken_before(&self, key: &str, share: f64, now: f64) -> u64 {
        match self.seen.get(key) {
            Some(&(live, until)) if until > now => (live as f64 * share).ceil() as u64,
            _ => 0,
        }
    }

    /// Takes a slot for `id` when fewer than `max` (this process's share of the limit,
    /// `share`) are held (or `id` holds one); else the live count.
    pub fn acquire(
        &mut self,
        key: &str,
        id: &str,
        max: u64,
        share: f64,
        now: f64,
    ) -> Result<(), u64> {
        let taken = self.taken_before(key, share, now);
        let held = self.live.get(key);
        let own = held.map_or(0, HashSet::len) as u64;
        if held.is_some_and(|ids| ids.contains(id)) || taken + own < max {
            let ids = self.live.entry(key.to_owned()).or_default();
            ids.insert(id.to_owned());
            Ok(())
        } else {
            Err(taken + own)
        }
    }

    pub fn release(&mut self, key: &str, id: &str) {
        if let Some(ids) = self.live.get_mut(key) {
            ids.remove(id);
            if ids.is_empty() {
                self.live.remove(key);
            }
        }
    }

    /// The leases held: this process's, and its `share` of those Redis last said were
    /// live, while they may still be.
    pub fn live(&self, key: &str, share: f64, now: f64) -> u64 {
        let own = self.live.get(key).map_or(0, |ids| ids.len() as u64);
        self.taken_before(key, share, now) + own
    }
}

/// What this process knows of a quota key: the counts Redis last answered for a period
/// (until `resets_at`, Unix seconds), and what it added locally since.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct QuotaCounts {
    resets_at: i64,
    seen: Usage,
    added: Usage,
}

/// A local quota answer: whether allowed, the remaining calls and rows (for the limits
/// given), and the period's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalQuota {
    pub allowed: bool,
    pub calls_remaining: Option<u64>,
    pub rows_remaining: Option<u64>,
    pub used: Usage,
    pub resets_at: i64,
}

pub struct LocalQuotas {
    keys: BoundedMap<String, QuotaCounts>,
}

impl Default for LocalQuotas {
    fn default() -> LocalQuotas {
        LocalQuotas {
            keys: BoundedMap::new(KEYS_KEPT),
        }
    }
}

impl LocalQuotas {
    /// Redis answered these counts (None: not told) for the period ending at
    /// `resets_at`, `now` in Unix seconds.
    pub fn saw(
        &mut self,
        key: &str,
        calls: Option<i64>,
        rows: Option<i64>,
        resets_at: i64,
        now: i64,
    ) {
        let counts = self.current(key, resets_at, now);
        counts.seen = Usage {
            calls: calls.unwrap_or(counts.seen.calls),
            rows: rows.unwrap_or(counts.seen.rows),
        };
        counts.added = Usage::default();
    }

    /// The counts of the period ending at `resets_at` (the period of `now`): nothing
    /// seen or added when what is kept belongs to an earlier period.
    fn current(&mut self, key: &str, resets_at: i64, now: i64) -> &mut QuotaCounts {
        let counts = self
            .keys
            .entry(key.to_owned(), QuotaCounts::default, |_, counts| {
                counts.resets_at <= now
            });
        if counts.resets_at != resets_at {
            *counts = QuotaCounts {
                resets_at,
                ..QuotaCounts::default()
            };
        }
        counts
    }

    /// Whether one more call fits: this process's adds since the last count seen stay
    /// below its share of what that count left, `floor((limit − seen) × share)`.
    pub fn check(
        &self,
        key: &str,
        limits: quota::Limits,
        resets_at: i64,
        share: f64,
    ) -> LocalQuota {
        let counts = self
            .keys
            .get(key)
            .filter(|counts| counts.resets_at == resets_at)
            .copied()
            .unwrap_or_default();
        let allowance = |limit: Option<i64>, seen: i64| {
            limit.map(|limit| seen + ((limit - seen).max(0) as f64 * share).floor() as i64)
        };
        let used = quota::add(counts.seen, counts.added).unwrap_or(Usage {
            calls: i64::MAX,
            rows: i64::MAX,
        });
        let local_limits = quota::Limits {
            calls: allowance(limits.calls, counts.seen.calls),
            rows: allowance(limits.rows, counts.seen.rows),
        };
        let check = quota::check(used, local_limits);
        LocalQuota {
            allowed: check.allowed,
            calls_remaining: check.calls_remaining.map(|n| n.max(0) as u64),
            rows_remaining: check.rows_remaining.map(|n| n.max(0) as u64),
            used,
            resets_at,
        }
    }

    /// Adds a call's counts locally (or, for a seed, raises the count seen), `now` in
    /// Unix seconds.
    pub fn add(&mut self, key: &str, counts: Usage, seed: bool, resets_at: i64, now: i64) -> Usage {
        let kept = self.current(key, resets_at, now);
        if seed {
            kept.seen = quota::seed(kept.seen, counts);
        } else {
            kept.added = quota::add(kept.added, counts).unwrap_or(kept.added);
        }
        quota::add(kept.seen, kept.added).unwrap_or(kept.seen)
    }

    fn forget_adds(&mut self) {
        for counts in self.keys.values_mut() {
            counts.added = Usage::default();
        }
    }
}

/// One scope's counts in this process, in windows of its length.
#[derive(Clone, Copy, Debug, Default)]
struct WindowCounts {
    window: i64,
    counters: Counters,
}

impl WindowCounts {
    /// The counters as of `clock`'s window: the last window's become the previous ones.
    fn at(&mut self, clock: &Clock) -> &mut Counters {
        let window = clock.window();
        if window != self.window {
            // Holds count until the end of the next window, as the module's do.
            let (previous, held) = if window == self.window + 1 {
                (
                    (self.counters.requests, self.counters.tokens),
                    self.counters.held,
                )
            } else {
                ((0, 0), 0)
            };
            self.window = window;
            self.counters = Counters {
                previous_requests: previous.0,
                previous_tokens: previous.1,
                held,
                ..Counters::default()
            };
        }
        &mut self.counters
    }
}

/// Sliding windows counted in this process. A scope's window starts from what Redis last
/// said was used of it ([`LocalWindows::saw`]: its limit less the least left over the
/// chain, which is at most what it had left; this process's share of that).
pub struct LocalWindows {
    scopes: BoundedMap<(String, i64), WindowCounts>,
    /// (key, window length) -> (window, requests used, tokens used: this process's share),
    /// Redis's last word.
    seen: BoundedMap<(String, i64), (i64, i64, i64)>,
}

impl Default for LocalWindows {
    fn default() -> LocalWindows {
        LocalWindows {
            scopes: BoundedMap::new(KEYS_KEPT),
            seen: BoundedMap::new(KEYS_KEPT),
        }
    }
}

/// The window `now_micros` is in, for a scope of `window_micros`: each entry is stale by
/// its own window's length, whatever the call's.
fn window_at(now_micros: i64, window_micros: i64) -> i64 {
    now_micros.div_euclid(window_micros.max(1))
}

impl LocalWindows {
    /// Redis admitted (or refused) a request on `scopes` (`key`, rpm, tpm), saying that
    /// `requests_left` and `tokens_left` are left (the least over the chain, so a scope
    /// that had more left begins stricter than it was), scaled by `share`.
    pub fn saw(
        &mut self,
        scopes: &[(&str, u64, u64)],
        clock: &Clock,
        requests_left: Option<u64>,
        tokens_left: Option<u64>,
        share: f64,
    ) {
        let window = clock.window();
        let now = clock.now_micros;
        let used = |limit: u64, left: Option<u64>| match left {
            Some(left) if limit > 0 => (limit.saturating_sub(left) as f64 * share).ceil() as i64,
            _ => 0,
        };
        for (key, rpm, tpm) in scopes {
            let counts = (window, used(*rpm, requests_left), used(*tpm, tokens_left));
            self.seen.insert(
                ((*key).to_owned(), clock.window_micros),
                counts,
                |(_, length), (seen, _, _)| *seen < window_at(now, *length),
            );
        }
    }

    /// QAG.ADMIT's decision on this process's counts, limits already scaled.
    pub fn admit(&mut self, scopes: &[(&str, window::Limits)], clock: &Clock) -> window::Admission {
        self.admit_reserving(scopes, clock, 0)
    }

    /// QAG.ADMIT … RESERVE's decision: admitted only if `reserve` tokens fit beside
    /// what is counted and held, then held on every scope until [`LocalWindows::release`]
    /// (or the end of the next window).
    pub fn admit_reserving(
        &mut self,
        scopes: &[(&str, window::Limits)],
        clock: &Clock,
        reserve: i64,
    ) -> window::Admission {
        let counted: Vec<(window::Limits, Counters)> = scopes
            .iter()
            .map(|(key, limits)| (*limits, *self.scope(key, clock)))
            .collect();
        let admission = window::admit(&counted, clock, reserve);
        if admission.admitted {
            for (key, _) in scopes {
                let counters = self.scope(key, clock);
                counters.requests += 1;
                counters.held = counters.held.saturating_add(reserve);
            }
        }
        admission
    }

    /// Stops holding `tokens` of a reservation on every scope (never below 0).
    pub fn release(&mut self, keys: &[&str], tokens: i64, clock: &Clock) {
        for key in keys {
            let counters = self.scope(key, clock);
            counters.held = counters.held.saturating_sub(tokens).max(0);
        }
    }

    /// Charges `tokens` to every scope's current window.
    pub fn record(&mut self, keys: &[&str], tokens: i64, clock: &Clock) {
        for key in keys {
            let counters = self.scope(key, clock);
            counters.tokens = counters.tokens.saturating_add(tokens);
        }
    }

    /// A scope's counters in this window; one not counted here yet begins from Redis's
    /// last word on it in this window.
    fn scope(&mut self, key: &str, clock: &Clock) -> &mut Counters {
        let name = (key.to_owned(), clock.window_micros);
        let seen = self.seen.get(&name).copied();
        let now = clock.now_micros;
        // A scope's counts matter until the end of its next window (its previous one).
        let stale = move |(_, length): &(String, i64), counts: &WindowCounts| {
            counts.window < window_at(now, *length) - 1
        };
        let counts = self.scopes.entry(
            name,
            || match seen {
                Some((window, requests, tokens)) if window == clock.window() => WindowCounts {
                    window,
                    counters: Counters {
                        requests,
                        tokens,
                        ..Counters::default()
                    },
                },
                _ => WindowCounts::default(),
            },
            stale,
        );
        counts.at(clock)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIVE_A_MINUTE: Limit = Limit {
        count: 5.0,
        period: 60.0,
    };

    #[test]
    fn a_bucket_of_five_refuses_the_sixth_and_refills() {
        let mut local = LocalBuckets::default();
        for left in (0..5).rev() {
            let verdict = local.take("k", FIVE_A_MINUTE, 1, 1000.0);
            assert_eq!(verdict.as_reply(), [1, left, 0]);
        }
        assert_eq!(
            local.take("k", FIVE_A_MINUTE, 1, 1000.0).as_reply(),
            [0, 0, 12]
        );
        assert_eq!(
            local.peek("k", FIVE_A_MINUTE, 1, 1012.0).as_reply(),
            [1, 0, 0]
        );
        assert_eq!(
            local.take("other", FIVE_A_MINUTE, 1, 1000.0).as_reply(),
            [1, 4, 0]
        );
        assert_eq!(local.refund("k", FIVE_A_MINUTE, 2, 1012.0), 3);
        assert_eq!(local.refund("missing", FIVE_A_MINUTE, 2, 1012.0), 5);
        local.clear();
        assert_eq!(
            local.take("k", FIVE_A_MINUTE, 1, 1000.0).as_reply(),
            [1, 4, 0]
        );
    }

    #[test]
    fn a_share_is_floored_and_never_below_one() {
        assert_eq!(share_of(60, 0.25), 15);
        assert_eq!(share_of(2, 1.0 / 3.0), 1);
        assert_eq!(share_of(7, 1.0), 7);
        assert_eq!(share_of(0, 0.5), 1);
    }

    #[test]
    fn leases_are_counted_per_key_up_to_the_max() {
        let mut leases = LocalLeases::default();
        assert_eq!(leases.acquire("k", "a", 2, 1.0, 0.0), Ok(()));
        assert_eq!(leases.acquire("k", "b", 2, 1.0, 0.0), Ok(()));
        assert_eq!(leases.acquire("k", "c", 2, 1.0, 0.0), Err(2));
        assert_eq!(
            leases.acquire("k", "a", 2, 1.0, 0.0),
            Ok(()),
            "a holder asking again"
        );
        assert_eq!(leases.acquire("other", "a", 2, 1.0, 0.0), Ok(()));
        leases.release("k", "a");
        assert_eq!(leases.live("k", 1.0, 0.0), 1);
        // An id that holds nothing here frees nothing (a guard of an earlier outage).
        leases.release("k", "old");
        assert_eq!(leases.live("k", 1.0, 0.0), 1);
        assert_eq!(leases.acquire("k", "c", 2, 1.0, 0.0), Ok(()));
        leases.release("gone", "a");
        assert_eq!(leases.live("gone", 1.0, 0.0), 0);
    }

    /// Issue 34: a bucket, a lease count and a window drained in Redis are not counted
    /// from fresh when Redis stops answering: each begins from Redis's last word.
    #[test]
    fn local_counting_begins_from_what_redis_last_said() {
        let now = 1_800_000_000.0;
        let limit = Limit {
            count: 60.0,
            period: 3600.0,
        };
        let mut buckets = LocalBuckets::default();
        buckets.saw("b", limit, 0, now);
        // A minute later one token has refilled (60 an hour).
        let allowed: Vec<bool> = (0..5)
            .map(|_| buckets.take("b", limit, 1, now + 60.0).allowed)
            .collect();
        assert_eq!(allowed, [true, false, false, false, false]);
        assert_eq!(
            buckets.take("fresh", limit, 1, now).tokens_left,
            59,
            "never seen: full"
        );
        // Half the share: half of what was left.
        buckets.saw("half", limit, 20, now);
        let half = Limit {
            count: 30.0,
            period: 3600.0,
        };
        assert_eq!(buckets.take("half", half, 1, now).tokens_left, 9);
        buckets.clear();
        assert!(
            buckets.peek("b", limit, 1, now + 60.0).allowed,
            "its last word stays"
        );
        // Leases: 4 of 4 live, each for 30 s at most.
        let mut leases = LocalLeases::default();
        leases.saw("l", 4, 30_000, now);
        assert_eq!(leases.acquire("l", "new", 4, 1.0, now + 1.0), Err(4));
        assert!(leases.live.is_empty(), "a refusal keeps nothing");
        assert_eq!(leases.live("l", 1.0, now + 1.0), 4);
        assert_eq!(
            leases.acquire("l", "new", 4, 1.0, now + 30.0),
            Ok(()),
            "run out"
        );
        // A window: the chain had 3 requests left of 10.
        let mut windows = LocalWindows::default();
        let clock = Clock::new(60, (now * 1e6) as i64);
        windows.saw(&[("w", 10, 0)], &clock, Some(3), None, 1.0);
        let limits = window::Limits { rpm: 10, tpm: 0 };
        let admitted = (0..5)
            .filter(|_| windows.admit(&[("w", limits)], &clock).admitted)
            .count();
        assert_eq!(admitted, 3);
    }

    const CALLS_10: quota::Limits = quota::Limits {
        calls: Some(10),
        rows: None,
    };

    #[test]
    fn a_quota_counts_from_the_last_count_seen_plus_local_adds() {
        let mut quotas = LocalQuotas::default();
        let ends = 2_000;
        quotas.saw("q", Some(7), None, ends, 1_000);
        for left in [2, 1, 0] {
            let check = quotas.check("q", CALLS_10, ends, 1.0);
            assert!(check.allowed);
            let used = quotas.add("q", Usage { calls: 1, rows: 5 }, false, ends, 1_000);
            assert_eq!(used.calls, 10 - left);
        }
        let check = quotas.check("q", CALLS_10, ends, 1.0);
        assert!(!check.allowed);
        assert_eq!(check.calls_remaining, Some(0));
        // A share of a half: half of the 3 left, floored.
        quotas.forget_adds();
        let mut allowed = 0;
        while quotas.check("q", CALLS_10, ends, 0.5).allowed {
            quotas.add("q", Usage { calls: 1, rows: 0 }, false, ends, 1_000);
            allowed += 1;
        }
        assert_eq!(allowed, 1);
        // A new period forgets the old one's counts.
        let next = quotas.check("q", CALLS_10, ends + 86_400, 1.0);
        assert_eq!(next.calls_remaining, Some(10));
        // A seed raises the count seen, never lowers it.
        let used = quotas.add("q", Usage { calls: 4, rows: 0 }, true, ends + 86_400, 1_000);
        assert_eq!(used.calls, 4);
        let used = quotas.add("q", Usage { calls: 2, rows: 0 }, true, ends + 86_400, 1_000);
        assert_eq!(used.calls, 4);
    }

    #[test]
    fn a_quota_never_seen_counts_from_zero() {
        let quotas = LocalQuotas::default();
        let check = quotas.check("new", CALLS_10, 5_000, 1.0);
        assert!(check.allowed);
        assert_eq!(check.calls_remaining, Some(10));
        assert_eq!(check.resets_at, 5_000);
    }

    #[test]
    fn local_reservations_hold_until_released_and_into_the_next_window() {
        let mut windows = LocalWindows::default();
        let limits = window::Limits { rpm: 0, tpm: 1000 };
        let clock = Clock::new(60, 1_000_000);
        let admitted = (0..12)
            .filter(|_| {
                windows
                    .admit_reserving(&[("s", limits)], &clock, 100)
                    .admitted
            })
            .count();
        assert_eq!(admitted, 10, "10 holds of 100 fill a tpm of 1000");
        windows.release(&["s"], 100, &clock);
        windows.record(&["s"], 40, &clock);
        assert!(
            windows
                .admit_reserving(&[("s", limits)], &clock, 60)
                .admitted
        );
        assert!(
            !windows
                .admit_reserving(&[("s", limits)], &clock, 1)
                .admitted
        );
        // The next window: the holds still count, the previous tokens fully at its start.
        let next = Clock::new(60, 61_000_000);
        assert!(!windows.admit_reserving(&[("s", limits)], &next, 1).admitted);
        windows.release(&["s"], 10_000, &next);
        assert!(
            windows
                .admit_reserving(&[("s", limits)], &next, 900)
                .admitted
        );
        // Two windows later nothing weighs, holds included.
        let later = Clock::new(60, 181_000_000);
        assert!(
            windows
                .admit_reserving(&[("s", limits)], &later, 1000)
                .admitted
        );
    }

    #[test]
    fn windows_admit_with_the_module_arithmetic_on_local_counts() {
        let mut windows = LocalWindows::default();
        let limits = window::Limits { rpm: 3, tpm: 100 };
        let clock = Clock::new(60, 600_000_000);
        for _ in 0..3 {
            assert!(windows.admit(&[("s", limits)], &clock).admitted);
        }
        let refused = windows.admit(&[("s", limits)], &clock);
        assert!(!refused.admitted);
        assert_eq!(refused.refused_by, 1);
        // Half way through the next window, the previous one weighs half: 1.5 + 1 ≤ 3.
        let later = Clock::new(60, 690_000_000);
        assert!(windows.admit(&[("s", limits)], &later).admitted);
        assert!(!windows.admit(&[("s", limits)], &later).admitted);
        // Tokens recorded count against tpm.
        windows.record(&["t"], 100, &clock);
        let tokens = window::Limits { rpm: 0, tpm: 100 };
        assert!(!windows.admit(&[("t", tokens)], &clock).admitted);
        // Two windows later nothing weighs.
        let much_later = Clock::new(60, 720_000_000);
        assert!(windows.admit(&[("t", tokens)], &much_later).admitted);
    }

    #[test]
    fn a_kind_keeps_at_most_its_bound_and_refilled_buckets_go_a_few_at_a_time() {
        let mut local = LocalBuckets::default();
        for n in 0..KEYS_KEPT + 10 {
            local.take(&n.to_string(), FIVE_A_MINUTE, 1, 1000.0);
        }
        assert_eq!(local.len(), KEYS_KEPT, "the oldest went");
        local.take("later", FIVE_A_MINUTE, 1, 1012.0);
        assert!(local.len() < KEYS_KEPT, "refilled ones went");
    }

    /// Issue 49: a call on a short window pruned every longer window's last word (their
    /// window numbers are smaller); each entry is now stale by its own window's length.
    #[test]
    fn a_short_window_keeps_a_long_ones_last_word() {
        let now = 1_800_000_000_000_000;
        let minute = Clock::new(60, now);
        let mut windows = LocalWindows::default();
        for n in 0..KEYS_KEPT {
            let key = format!("m{n}");
            windows.saw(&[(&key, 12, 0)], &minute, Some(0), None, 1.0);
        }
        let second = Clock::new(1, now + 1_500_000);
        windows.saw(&[("s", 10, 0)], &second, Some(9), None, 1.0);
        let later = Clock::new(60, now + 1_500_000);
        let limits = window::Limits { rpm: 12, tpm: 0 };
        let admitted = (0..12)
            .filter(|_| windows.admit(&[("m50000", limits)], &later).admitted)
            .count();
        assert_eq!(admitted, 0, "Redis said 0 were left");
    }

    #[test]
    fn a_quota_check_remembers_nothing_new() {
        let mut quotas = LocalQuotas::default();
        for n in 0..1000 {
            assert!(quotas.check(&n.to_string(), CALLS_10, 2_000, 1.0).allowed);
        }
        assert_eq!(quotas.keys.len(), 0);
        quotas.add("q", Usage { calls: 1, rows: 0 }, false, 2_000, 1_000);
        assert_eq!(quotas.keys.len(), 1);
    }
}
