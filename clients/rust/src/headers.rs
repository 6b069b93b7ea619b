//! The response header fields a gateway sends for its decisions, as lowercase (name,
//! value) pairs for any HTTP framework or as an `http::HeaderMap`. The same fields,
//! values and order as the Python client's `headers()`: both are checked against
//! `clients/shared_cases.json`.
//!
//! - `x-ratelimit-limit` / `-remaining`: the client's (server-wide) bucket;
//!   `x-ratelimit-key-limit` / `-remaining`: the key's bucket, as the gateway sends them.
//! - `x-quota-remaining-calls` / `-rows` (for the limits the quota has) and
//!   `x-quota-reset` (the period's end, Unix seconds).
//! - For a window chain (a model gateway's requests and tokens a minute), the fields
//!   OpenAI's SDKs read: `x-ratelimit-limit-requests`, `-limit-tokens`,
//!   `-remaining-requests`, `-remaining-tokens`, `-reset-requests`, `-reset-tokens`:
//!   the chain's least limit of each kind, the least left over the chain (tokens held by
//!   reservations counted, as QAG.ADMIT answers it), and the time until what counts now
//!   has stopped counting (at the latest the end of the next window; `0s` when nothing
//!   is counted), written as Go writes a duration (`12ms`, `1s`, `1m30s`, `6m0s`).
//! - `ratelimit-policy` and `ratelimit` of draft-ietf-httpapi-ratelimit-headers-11: one
//!   item per limit that applies, in the order they are asked: `"client"` and `"key"`
//!   (buckets, unit `requests`, window `w` the period in whole seconds), `"calls"`
//!   (unit `requests`) and `"rows"` (unit `rows`, not one of the draft's units: a client
//!   that knows only those skips it) of a quota, without `w` (a calendar period has no
//!   fixed length), and `"concurrency"` (unit `concurrent-requests`). `ratelimit` gives
//!   each one's remaining `r` and the seconds `t` until it is restored (none for a slot
//!   held: concurrency has no window), the most restrictive first. A refusing limit's `t`
//!   is its wait, so the first item's `t` is `retry-after`.
//! - `retry-after`: on a refusal, the whole seconds until every refusing limit lets the
//!   request through (the longest wait); left out when the request can never fit;
//!   1 for a concurrency slot.
//! - A decision answered by the `Forward` policy counted nothing and renders nothing.
//!
//! The most restrictive limit is a refusing one (one that never fits first, then the
//! longest wait), else the one with the fewest remaining (on a tie, the one restored
//! later, then the order they are asked in).

use std::time::Duration;

use crate::decision::{
    Admission, AnsweredBy, Decision, LeaseRefusal, PairDecision, QuotaDecision, Scope,
};

/// A window chain's default window, as QAG.ADMIT's.
const DEFAULT_WINDOW: u32 = 60;

/// The fields of a window chain's requests, then tokens: limit, remaining, reset.
const WINDOW_FIELDS: [[&str; 3]; 2] = [
    [
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    ],
    [
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ],
];

/// One limit as the draft's fields see it.
struct Limit {
    name: &'static str,
    quota: u64,
    unit: &'static str,
    window: Option<u64>,
    remaining: u64,
    /// Seconds until it is restored; None for a slot held (no window).
    reset: Option<u64>,
    /// When refused: the wait until it lets the request through; None when it never will.
    refusal: Option<Option<u64>>,
}

impl Limit {
    fn bucket(name: &'static str, decision: &Decision) -> Limit {
        let refusal = (!decision.allowed).then(|| decision.retry_after.seconds().map(at_least_1));
        Limit {
            name,
            quota: decision.limit,
            unit: "requests",
            window: Some((decision.period.ceil() as u64).max(1)),
            remaining: decision.remaining,
            reset: Some(match refusal {
                Some(Some(wait)) => wait,
                _ => decision.seconds_to_full(),
            }),
            refusal,
        }
    }

    fn quota(
        (name, unit): (&'static str, &'static str),
        limit: Option<u64>,
        remaining: Option<u64>,
        decision: &QuotaDecision,
        now: i64,
    ) -> Option<Limit> {
        let (quota, remaining) = (limit?, remaining?);
        let reset = u64::try_from(decision.resets_at.saturating_sub(now)).unwrap_or(0);
        let refused = !decision.allowed && remaining == 0;
        let reset = if refused { at_least_1(reset) } else { reset };
        Some(Limit {
            name,
            quota,
            unit,
            window: None,
            remaining,
            reset: Some(reset),
            refusal: refused.then_some(Some(reset)),
        })
    }

    fn slots(slots: Slots, refused: bool) -> Limit {
        Limit {
            name: "concurrency",
            quota: slots.max,
            unit: "concurrent-requests",
            window: None,
            remaining: if refused {
                0
            } else {
                slots.max.saturating_sub(slots.live)
            },
            // A slot may be released at any time: ask again in a second.
            reset: refused.then_some(1),
            refusal: refused.then_some(Some(1)),
        }
    }

    /// Orders limits by restrictiveness, the most restrictive least.
    fn restrictiveness(&self) -> (u8, u64, u64) {
        match self.refusal {
            Some(None) => (0, 0, 0),
            Some(Some(wait)) => (1, u64::MAX - wait, 0),
            None => (2, self.remaining, u64::MAX - self.reset.unwrap_or(0)),
        }
    }

    fn policy_item(&self) -> String {
        let mut item = format!("\"{}\";q={};qu=\"{}\"", self.name, self.quota, self.unit);
        if let Some(window) = self.window {
            item.push_str(&format!(";w={window}"));
        }
        item
    }

    fn service_item(&self) -> String {
        let mut item = format!("\"{}\";r={}", self.name, self.remaining);
        if let Some(reset) = self.reset {
            item.push_str(&format!(";t={reset}"));
        }
        item
    }
}

fn at_least_1(seconds: u64) -> u64 {
    seconds.max(1)
}

/// A key's concurrency limit and the live leases when this request asked (its own
/// included when it took one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slots {
    max: u64,
    live: u64,
}

/// A window chain's admission, with its scopes and window length.
#[derive(Clone, Copy, Debug)]
struct Chain<'a> {
    scopes: &'a [Scope],
    admission: &'a Admission,
    window: u32,
}

/// The header fields of a request's decisions, built up and rendered once:
///
/// ```
/// # use qag_client::{headers::Headers, AnsweredBy, Decision, RetryAfter};
/// let key = Decision { allowed: false, limit: 60, period: 60.0, remaining: 0,
///                      retry_after: RetryAfter::Seconds(3),
///                      answered_by: AnsweredBy::Module,
///                      waited: std::time::Duration::ZERO };
/// let fields = Headers::new().key(&key).without_draft().fields();
/// assert_eq!(fields, [("x-ratelimit-key-limit", "60".to_string()),
///                     ("x-ratelimit-key-remaining", "0".to_string()),
///                     ("retry-after", "3".to_string())]);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Headers<'a> {
    client: Option<&'a Decision>,
    key: Option<&'a Decision>,
    quota: Option<&'a QuotaDecision>,
    slots: Option<Slots>,
    lease_refused: bool,
    chain: Option<Chain<'a>>,
    /// Unix milliseconds.
    now: Option<i64>,
    draft: bool,
    /// How long the request's slot waited (its buckets' waits are in their decisions).
    slot_waited: Duration,
}

impl Default for Headers<'_> {
    fn default() -> Self {
        Headers::new()
    }
}

impl<'a> Headers<'a> {
    pub fn new() -> Self {
        Headers {
            client: None,
            key: None,
            quota: None,
            slots: None,
            lease_refused: false,
            chain: None,
            now: None,
            draft: true,
            slot_waited: Duration::ZERO,
        }
    }

    /// The client's (per-address) bucket. A forwarded decision counted nothing and
    /// renders nothing.
    pub fn client(mut self, decision: &'a Decision) -> Self {
        self.client = counted(decision);
        self
    }

    /// The key's bucket.
    pub fn key(mut self, decision: &'a Decision) -> Self {
        self.key = counted(decision);
        self
    }

    /// Both buckets of a pair (the key's only when it was counted).
    pub fn pair(self, pair: &'a PairDecision) -> Self {
        let with_client = self.client(&pair.client);
        match &pair.key {
            Some(key) => with_client.key(key),
            None => with_client,
        }
    }

    /// The key's quota: after the call's add, give
    /// [`QuotaDecision::after_add`] so the last allowed call reports 0 left.
    pub fn quota(mut self, decision: &'a QuotaDecision) -> Self {
        self.quota = (decision.answered_by != AnsweredBy::Forwarded).then_some(decision);
        self
    }

    /// The key's concurrency limit, `max` slots, and the `live` leases when the request
    /// asked for one (its own included if it took it): the draft's `"concurrency"` item.
    /// Leave it out for a slot the `Forward` policy answered (it counted nothing).
    pub fn slots(mut self, max: u64, live: u64) -> Self {
        self.slots = Some(Slots { max, live });
        self
    }

    /// How long the request waited for its slot ([`LeaseGuard::waited`](crate::LeaseGuard),
    /// or a refusal's): with its buckets' waits, the `server-timing` field's
    /// `qag-wait;dur=<ms>`.
    pub fn slot_waited(mut self, waited: Duration) -> Self {
        self.slot_waited = waited;
        self
    }

    /// Every concurrency slot was held: `retry-after: 1` unless a limit asks longer
    /// (with [`slots`](Self::slots), the `"concurrency"` item refuses, `r=0;t=1`).
    pub fn lease_refused(mut self, _refusal: &LeaseRefusal) -> Self {
        self.lease_refused = true;
        self
    }

    /// A window chain's admission (QAG.ADMIT, or a reservation's), its `scopes` and
    /// `window` (None: QAG.ADMIT's default, 60 s): the `x-ratelimit-*-requests` and
    /// `x-ratelimit-*-tokens` fields a model API's callers read, and a refusal's
    /// `retry-after`. A forwarded admission counted nothing and renders nothing.
    pub fn window(
        mut self,
        scopes: &'a [Scope],
        admission: &'a Admission,
        window: Option<u32>,
    ) -> Self {
        self.chain = (admission.answered_by != AnsweredBy::Forwarded).then_some(Chain {
            scopes,
            admission,
            window: window.unwrap_or(DEFAULT_WINDOW).max(1),
        });
        self
    }

    /// The clock in Unix seconds, for the time left in a quota's period (default: now).
    pub fn now(self, now: i64) -> Self {
        self.now_millis(now.saturating_mul(1000))
    }

    /// The clock in Unix milliseconds (a window's reset is written to the millisecond).
    pub fn now_millis(mut self, now: i64) -> Self {
        self.now = Some(now);
        self
    }

    /// Leaves out the draft's `ratelimit-policy` and `ratelimit` fields.
    pub fn without_draft(mut self) -> Self {
        self.draft = false;
        self
    }

    /// The fields as lowercase (name, value) pairs, for any HTTP framework.
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        render(self)
    }

    /// The fields as an `http::HeaderMap`, the type every Rust HTTP stack shares.
    pub fn header_map(&self) -> http::HeaderMap {
        let mut map = http::HeaderMap::new();
        for (name, value) in self.fields() {
            // Every value is digits, quotes, semicolons, equals signs and letters.
            if let Ok(value) = http::HeaderValue::from_str(&value) {
                map.insert(http::HeaderName::from_static(name), value);
            }
        }
        map
    }
}

fn counted(decision: &Decision) -> Option<&Decision> {
    (decision.answered_by != AnsweredBy::Forwarded).then_some(decision)
}

fn unix_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as i64)
}

/// A duration as Go's `time.Duration` writes it, which OpenAI's reset fields use:
/// `0s`, `12ms`, `1s`, `1.5s`, `1m30s`, `6m0s`, `2h0m0s`.
pub fn go_duration(millis: u64) -> String {
    if millis == 0 {
        return "0s".into();
    }
    if millis < 1000 {
        return format!("{millis}ms");
    }
    let (hours, minutes) = (millis / 3_600_000, millis / 60_000 % 60);
    let milli = millis % 60_000;
    let mut seconds = format!("{}.{:03}", milli / 1000, milli % 1000);
    while seconds.ends_with('0') {
        seconds.pop();
    }
    let seconds = seconds.trim_end_matches('.');
    match (hours, minutes) {
        (0, 0) => format!("{seconds}s"),
        (0, _) => format!("{minutes}m{seconds}s"),
        _ => format!("{hours}h{minutes}m{seconds}s"),
    }
}

/// One kind of a window chain (requests or tokens): the least limit of that kind, the
/// least left (QAG.ADMIT's), and the milliseconds until what counts has stopped
/// counting: what is counted in the current window counts, less and less, until the end
/// of the next one.
fn window_kind(
    limits: impl Iterator<Item = u64>,
    remaining: Option<u64>,
    window: u32,
    now: i64,
) -> Option<[String; 3]> {
    let limit = limits.filter(|&limit| limit > 0).min()?;
    let remaining = remaining.unwrap_or(limit).min(limit);
    let reset = if remaining == limit {
        0
    } else {
        let length = i64::from(window) * 1000;
        (now.div_euclid(length) + 2) * length - now
    };
    Some([
        limit.to_string(),
        remaining.to_string(),
        go_duration(reset.max(0) as u64),
    ])
}

fn render(request: &Headers<'_>) -> Vec<(&'static str, String)> {
    let now_millis = request.now.unwrap_or_else(unix_millis);
    let now = now_millis.div_euclid(1000);
    let mut fields = Vec::new();
    let mut limits = Vec::new();
    // Waits of refusals that no draft item stands for (a window chain's).
    let mut other_refusals = Vec::new();
    if let Some(client) = request.client {
        fields.push(("x-ratelimit-limit", client.limit.to_string()));
        fields.push(("x-ratelimit-remaining", client.remaining.to_string()));
        limits.push(Limit::bucket("client", client));
    }
    if let Some(key) = request.key {
        fields.push(("x-ratelimit-key-limit", key.limit.to_string()));
        fields.push(("x-ratelimit-key-remaining", key.remaining.to_string()));
        limits.push(Limit::bucket("key", key));
    }
    if let Some(quota) = request.quota {
        if let Some(calls) = quota.calls_remaining {
            fields.push(("x-quota-remaining-calls", calls.to_string()));
        }
        if let Some(rows) = quota.rows_remaining {
            fields.push(("x-quota-remaining-rows", rows.to_string()));
        }
        fields.push(("x-quota-reset", quota.resets_at.to_string()));
        let (calls, rows) = (
            (quota.calls_limit, quota.calls_remaining),
            (quota.rows_limit, quota.rows_remaining),
        );
        limits.extend(Limit::quota(
            ("calls", "requests"),
            calls.0,
            calls.1,
            quota,
            now,
        ));
        limits.extend(Limit::quota(("rows", "rows"), rows.0, rows.1, quota, now));
    }
    match request.slots {
        Some(slots) => limits.push(Limit::slots(slots, request.lease_refused)),
        None if request.lease_refused => other_refusals.push(Some(1)),
        None => {}
    }
    if let Some(chain) = request.chain {
        let (scopes, admission) = (chain.scopes, chain.admission);
        let kinds = [
            window_kind(
                scopes.iter().map(|scope| scope.rpm),
                admission.requests_remaining,
                chain.window,
                now_millis,
            ),
            window_kind(
                scopes.iter().map(|scope| scope.tpm),
                admission.tokens_remaining,
                chain.window,
                now_millis,
            ),
        ];
        // OpenAI's order: both limits, both remaining, both resets.
        for part in 0..3 {
            for (kind, names) in kinds.iter().zip(WINDOW_FIELDS) {
                if let Some(values) = kind {
                    fields.push((names[part], values[part].clone()));
                }
            }
        }
        if !admission.admitted {
            other_refusals.push(admission.retry_after.seconds().map(at_least_1));
        }
    }
    let refusals: Vec<Option<u64>> = limits
        .iter()
        .filter_map(|limit| limit.refusal)
        .chain(other_refusals)
        .collect();
    let retry_after = if !refusals.is_empty() && refusals.iter().all(Option::is_some) {
        refusals.iter().flatten().max().copied()
    } else {
        None
    };
    if request.draft && !limits.is_empty() {
        let policy: Vec<String> = limits.iter().map(Limit::policy_item).collect();
        fields.push(("ratelimit-policy", policy.join(", ")));
        limits.sort_by_key(Limit::restrictiveness);
        let service: Vec<String> = limits.iter().map(Limit::service_item).collect();
        fields.push(("ratelimit", service.join(", ")));
    }
    // How long the server held the request (`WAIT`): its buckets' wait (one, taken
    // together) and its slot's.
    let buckets = [request.client, request.key]
        .into_iter()
        .flatten()
        .map(|decision| decision.waited)
        .max()
        .unwrap_or_default();
    let waited = (buckets + request.slot_waited).as_millis();
    if waited > 0 {
        fields.push(("server-timing", format!("qag-wait;dur={waited}")));
    }
    if let Some(wait) = retry_after {
        fields.push(("retry-after", wait.to_string()));
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_as_go_writes_them() {
        let cases = [
            (0, "0s"),
            (12, "12ms"),
            (999, "999ms"),
            (1000, "1s"),
            (1500, "1.5s"),
            (1230, "1.23s"),
            (59_999, "59.999s"),
            (60_000, "1m0s"),
            (90_500, "1m30.5s"),
            (360_000, "6m0s"),
            (3_600_000, "1h0m0s"),
            (7_384_000, "2h3m4s"),
        ];
        for (millis, text) in cases {
            assert_eq!(go_duration(millis), text, "{millis} ms");
        }
    }

    #[test]
    fn a_window_resets_at_the_end_of_the_next_window() {
        // 12.5 s into a minute (1,800,000,000 s is one's start): what counts now stops
        // counting 107.5 s from now.
        let now = 1_800_000_012_500;
        let kind = window_kind([60, 0, 1000].into_iter(), Some(59), 60, now);
        assert_eq!(kind, Some(["60".into(), "59".into(), "1m47.5s".into()]));
        let full = window_kind([60].into_iter(), Some(60), 60, now);
        assert_eq!(full, Some(["60".into(), "60".into(), "0s".into()]));
        assert_eq!(window_kind([0, 0].into_iter(), None, 60, now), None);
    }
}
