//! The response header fields a gateway sends for its decisions, as lowercase (name,
//! value) pairs for any HTTP framework or as an `http::HeaderMap`. The same fields,
//! values and order as the Python client's `headers()`: both are checked against
//! `clients/shared_cases.json`.
//!
//! - `x-ratelimit-limit` / `-remaining`: the client's (server-wide) bucket;
//!   `x-ratelimit-key-limit` / `-remaining`: the key's bucket, as the gateway sends them.
//! - `x-quota-remaining-calls` / `-rows` (for the limits the quota has) and
//!   `x-quota-reset` (the period's end, Unix seconds).
//! - `ratelimit-policy` and `ratelimit` of draft-ietf-httpapi-ratelimit-headers (-09):
//!   the policy lists every limit (`"client"`, `"key"`, `"calls"`, `"rows"`) with its
//!   quota `q` and, for buckets, its window `w` in whole seconds; `ratelimit` holds the
//!   most restrictive one with what remains `r` and the seconds `t` until it is restored.
//! - `retry-after`: on a refusal, the whole seconds until every refusing limit lets the
//!   request through (the longest wait); left out when the request can never fit;
//!   1 when only a concurrency slot was refused.
//! - A decision answered by the `Forward` policy counted nothing and renders nothing.
//!
//! The most restrictive limit is a refusing one (the longest wait; one that never fits
//! before any), else the one with the fewest remaining (on a tie, the first of client,
//! key, calls, rows).

use crate::decision::{AnsweredBy, Decision, LeaseRefusal, PairDecision, QuotaDecision};

/// One limit as the header fields see it.
struct Limit {
    name: &'static str,
    quota: u64,
    window: Option<u64>,
    remaining: u64,
    /// Seconds until it is restored (a bucket full again, a quota's period over).
    reset: u64,
    /// When refused: the wait until it lets the request through; None when it never will.
    refusal: Option<Option<u64>>,
}

impl Limit {
    fn bucket(name: &'static str, decision: &Decision) -> Limit {
        let wait = decision.retry_after.seconds();
        Limit {
            name,
            quota: decision.limit,
            window: Some((decision.period.ceil() as u64).max(1)),
            remaining: decision.remaining,
            reset: match (decision.allowed, wait) {
                (false, Some(wait)) => wait,
                _ => decision.seconds_to_full(),
            },
            refusal: (!decision.allowed).then_some(wait),
        }
    }

    fn quota(
        name: &'static str,
        limit: Option<u64>,
        remaining: Option<u64>,
        decision: &QuotaDecision,
        now: i64,
    ) -> Option<Limit> {
        let (quota, remaining) = (limit?, remaining?);
        let reset = u64::try_from(decision.resets_at.saturating_sub(now)).unwrap_or(0);
        Some(Limit {
            name,
            quota,
            window: None,
            remaining,
            reset,
            refusal: (!decision.allowed && remaining == 0).then_some(Some(reset.max(1))),
        })
    }

    /// Orders limits by restrictiveness, the most restrictive least.
    fn restrictiveness(&self) -> (u8, u64, u64) {
        match self.refusal {
            Some(None) => (0, 0, 0),
            Some(Some(wait)) => (1, u64::MAX - wait, 0),
            None => (2, self.remaining, u64::MAX - self.reset),
        }
    }
}

/// The header fields of a request's decisions, built up and rendered once:
///
/// ```
/// # use qag_client::{headers::Headers, AnsweredBy, Decision, RetryAfter};
/// let key = Decision { allowed: false, limit: 60, period: 60.0, remaining: 0,
///                      retry_after: RetryAfter::Seconds(3),
///                      answered_by: AnsweredBy::Module };
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
    lease_refused: bool,
    now: Option<i64>,
    draft: bool,
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
            lease_refused: false,
            now: None,
            draft: true,
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

    /// Every concurrency slot was held: `retry-after: 1` unless a limit asks longer.
    pub fn lease_refused(mut self, _refusal: &LeaseRefusal) -> Self {
        self.lease_refused = true;
        self
    }

    /// The clock in Unix seconds, for the time left in a quota's period (default: now).
    pub fn now(mut self, now: i64) -> Self {
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
            // Every value is digits, quotes, semicolons and letters: always valid.
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

fn unix_seconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs() as i64)
}

fn render(request: &Headers<'_>) -> Vec<(&'static str, String)> {
    let now = request.now.unwrap_or_else(unix_seconds);
    let mut fields = Vec::new();
    let mut limits = Vec::new();
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
        limits.extend(Limit::quota(
            "calls",
            quota.calls_limit,
            quota.calls_remaining,
            quota,
            now,
        ));
        limits.extend(Limit::quota(
            "rows",
            quota.rows_limit,
            quota.rows_remaining,
            quota,
            now,
        ));
    }
    let refusals: Vec<Option<u64>> = limits.iter().filter_map(|limit| limit.refusal).collect();
    let retry_after = if !refusals.is_empty() && refusals.iter().all(Option::is_some) {
        Some(refusals.iter().flatten().max().copied().unwrap_or(1).max(1))
    } else if request.lease_refused && refusals.is_empty() {
        Some(1)
    } else {
        None
    };
    if request.draft {
        if let Some(tightest) = limits.iter().min_by_key(|limit| limit.restrictiveness()) {
            let policy: Vec<String> = limits
                .iter()
                .map(|limit| match limit.window {
                    Some(window) => format!("\"{}\";q={};w={window}", limit.name, limit.quota),
                    None => format!("\"{}\";q={}", limit.name, limit.quota),
                })
                .collect();
            fields.push(("ratelimit-policy", policy.join(", ")));
            fields.push((
                "ratelimit",
                format!(
                    "\"{}\";r={};t={}",
                    tightest.name, tightest.remaining, tightest.reset
                ),
            ));
        }
    }
    if let Some(wait) = retry_after {
        fields.push(("retry-after", wait.to_string()));
    }
    fields
}
