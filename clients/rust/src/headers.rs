//! The response header fields a gateway sends for its decisions, as (name, value)
//! pairs for any HTTP framework. The same fields, values and order as the Python
//! client's `headers()`: both are checked against `clients/header_cases.json`.
//!
//! - `X-RateLimit-Limit` / `-Remaining`: the client's (server-wide) bucket;
//!   `X-RateLimit-Key-Limit` / `-Remaining`: the key's bucket, as the gateway sends them.
//! - `X-Quota-Remaining-Calls` / `-Rows` (for the limits the quota has) and
//!   `X-Quota-Reset` (the period's end, Unix seconds).
//! - `RateLimit-Policy` and `RateLimit` of draft-ietf-httpapi-ratelimit-headers (-09):
//!   the policy lists every limit (`"client"`, `"key"`, `"calls"`, `"rows"`) with its
//!   quota `q` and, for buckets, its window `w` in whole seconds; `RateLimit` holds the
//!   most restrictive one with what remains `r` and the seconds `t` until it is restored.
//! - `Retry-After`: on a refusal, the whole seconds until every refusing limit lets the
//!   request through (the longest wait); left out when the request can never fit.
//!
//! The most restrictive limit is a refusing one (the longest wait; one that never fits
//! before any), else the one with the fewest remaining (on a tie, the first of client,
//! key, calls, rows).

use crate::decision::{Decision, QuotaDecision};

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
        let wait = u64::try_from(decision.retry_after).ok();
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

/// The header fields for a request's decisions; `now` in Unix seconds (for the time
/// left in a quota's period).
pub fn headers(
    client: Option<&Decision>,
    key: Option<&Decision>,
    quota: Option<&QuotaDecision>,
    now: i64,
) -> Vec<(&'static str, String)> {
    let mut fields = Vec::new();
    let mut limits = Vec::new();
    if let Some(client) = client {
        fields.push(("X-RateLimit-Limit", client.limit.to_string()));
        fields.push(("X-RateLimit-Remaining", client.remaining.to_string()));
        limits.push(Limit::bucket("client", client));
    }
    if let Some(key) = key {
        fields.push(("X-RateLimit-Key-Limit", key.limit.to_string()));
        fields.push(("X-RateLimit-Key-Remaining", key.remaining.to_string()));
        limits.push(Limit::bucket("key", key));
    }
    if let Some(quota) = quota {
        if let Some(calls) = quota.calls_remaining {
            fields.push(("X-Quota-Remaining-Calls", calls.to_string()));
        }
        if let Some(rows) = quota.rows_remaining {
            fields.push(("X-Quota-Remaining-Rows", rows.to_string()));
        }
        fields.push(("X-Quota-Reset", quota.resets_at.to_string()));
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
    let Some(tightest) = limits.iter().min_by_key(|limit| limit.restrictiveness()) else {
        return fields;
    };
    let policy: Vec<String> = limits
        .iter()
        .map(|limit| match limit.window {
            Some(window) => format!("\"{}\";q={};w={window}", limit.name, limit.quota),
            None => format!("\"{}\";q={}", limit.name, limit.quota),
        })
        .collect();
    fields.push(("RateLimit-Policy", policy.join(", ")));
    fields.push((
        "RateLimit",
        format!(
            "\"{}\";r={};t={}",
            tightest.name, tightest.remaining, tightest.reset
        ),
    ));
    let refusals: Vec<Option<u64>> = limits.iter().filter_map(|limit| limit.refusal).collect();
    if !refusals.is_empty() && refusals.iter().all(Option::is_some) {
        let wait = refusals.iter().flatten().max().copied().unwrap_or(1);
        fields.push(("Retry-After", wait.max(1).to_string()));
    }
    fields
}
