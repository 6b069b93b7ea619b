//! What the limiter answers, as plain values, and how a server's reply becomes one.

use std::fmt;
use std::time::Duration;

/// Which path answered a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AnsweredBy {
    /// The module's QAG.* command.
    Module,
    /// Without the module: the token-bucket script (QAG.PEEK's fallback reads the
    /// bucket's hash and computes with the module's arithmetic).
    Script,
    /// This process's own memory, during a back-off after Redis failed
    /// ([`OnUnavailable::Local`](crate::OnUnavailable::Local)).
    Local,
    /// Not counted: Redis failed and the caller lets the request through
    /// ([`OnUnavailable::Forward`](crate::OnUnavailable::Forward)).
    Forwarded,
}

impl AnsweredBy {
    pub fn as_str(self) -> &'static str {
        match self {
            AnsweredBy::Module => "module",
            AnsweredBy::Script => "script",
            AnsweredBy::Local => "local",
            AnsweredBy::Forwarded => "forwarded",
        }
    }
}

impl fmt::Display for AnsweredBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How long to wait before asking again, the same type for every family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RetryAfter {
    /// Whole seconds (0 when the call was allowed).
    Seconds(u64),
    /// Never: the cost is above the bucket's count.
    Never,
}

impl RetryAfter {
    /// The seconds, or None for never.
    pub fn seconds(self) -> Option<u64> {
        match self {
            RetryAfter::Seconds(seconds) => Some(seconds),
            RetryAfter::Never => None,
        }
    }

    /// From a reply's integer: -1 is never, a negative other value an error.
    pub fn from_reply(value: i64) -> Result<RetryAfter, String> {
        match value {
            -1 => Ok(RetryAfter::Never),
            n => non_negative(n, "retry_after").map(RetryAfter::Seconds),
        }
    }
}

/// Whole seconds, or `never`.
impl fmt::Display for RetryAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RetryAfter::Seconds(seconds) => write!(f, "{seconds}"),
            RetryAfter::Never => f.write_str("never"),
        }
    }
}

/// The two buckets of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The client's bucket (e.g. per address): the server-wide limit.
    Client,
    /// The key's bucket (per API key or partner).
    Key,
}

/// One token bucket's answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    pub allowed: bool,
    /// The bucket's count: its capacity and its refill per period.
    pub limit: u64,
    /// The bucket's period in seconds.
    pub period: f64,
    /// Whole tokens left after the call (floor).
    pub remaining: u64,
    /// Until the cost fits: 0 s when allowed, `Never` for a cost above the count.
    pub retry_after: RetryAfter,
    pub answered_by: AnsweredBy,
    /// How long the server held the call for its tokens (`Limiter::with_wait`): zero for
    /// one answered at once.
    pub waited: Duration,
}

impl Decision {
    /// A decision from QAG.TAKE's (or the script's) reply `[allowed, left, retry]`, or
    /// with WAIT `[allowed, left, retry, waited_ms]`.
    pub fn from_reply(
        reply: &[i64],
        limit: u64,
        period: f64,
        answered_by: AnsweredBy,
    ) -> Result<Decision, String> {
        let (verdict, waited) = match reply {
            [verdict @ .., waited] if reply.len() == 4 => (verdict, *waited),
            _ => (reply, 0),
        };
        match *verdict {
            [allowed @ (0 | 1), left, retry] if left >= 0 && retry >= -1 => Ok(Decision {
                allowed: allowed == 1,
                limit,
                period,
                remaining: left as u64,
                retry_after: RetryAfter::from_reply(retry)?,
                answered_by,
                waited: Duration::from_millis(non_negative(waited, "waited")?),
            }),
            _ => Err(format!(
                "a bucket reply of three integers (four with WAIT), got {reply:?}"
            )),
        }
    }

    /// Seconds until the bucket is full again, as far as its whole tokens tell:
    /// the missing tokens at `limit` per `period`, rounded up.
    pub fn seconds_to_full(&self) -> u64 {
        let missing = self.limit.saturating_sub(self.remaining) as f64;
        (missing * self.period / self.limit as f64).ceil() as u64
    }
}

/// What a refund left: the bucket's whole tokens after it (its count when forwarded:
/// nothing was given back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refunded {
    pub remaining: u64,
    pub answered_by: AnsweredBy,
}

/// Both buckets of a request: the client's, then the key's when the client's allowed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PairDecision {
    pub client: Decision,
    /// None when the client's bucket refused: the key's was not counted.
    pub key: Option<Decision>,
}

impl PairDecision {
    pub fn allowed(&self) -> bool {
        self.client.allowed && self.key.is_some_and(|key| key.allowed)
    }

    /// The bucket that refused, if one did.
    pub fn refused_by(&self) -> Option<Side> {
        match self.key {
            _ if !self.client.allowed => Some(Side::Client),
            Some(key) if !key.allowed => Some(Side::Key),
            _ => None,
        }
    }

    /// The refusing bucket's retry after (0 s when allowed).
    pub fn retry_after(&self) -> RetryAfter {
        match (self.refused_by(), self.key) {
            (Some(Side::Client), _) => self.client.retry_after,
            (Some(Side::Key), Some(key)) => key.retry_after,
            _ => RetryAfter::Seconds(0),
        }
    }

    pub fn answered_by(&self) -> AnsweredBy {
        self.client.answered_by
    }
}

/// A request's buckets and its quota's check, asked together
/// ([`Limiter::take_with_quota`](crate::Limiter::take_with_quota)).
#[derive(Debug)]
pub struct TakenWithQuota {
    /// The client's bucket, if one was given.
    pub client: Option<Decision>,
    /// The key's bucket, if one was given and counted (None when the client's refused).
    pub key: Option<Decision>,
    /// The quota's check (it counts nothing), or the error it met: a request a bucket
    /// refused is answered by that refusal whatever the check says, so the check's
    /// failure never turns it into another answer.
    pub quota: Result<QuotaDecision, crate::Error>,
}

impl TakenWithQuota {
    /// Whether both buckets allowed (the quota is the caller's to read).
    pub fn buckets_allowed(&self) -> bool {
        [self.client, self.key]
            .iter()
            .flatten()
            .all(|decision| decision.allowed)
    }
}

/// A quota's period: a calendar day or month in a time zone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Per {
    Day,
    Month,
}

impl Per {
    pub fn as_str(self) -> &'static str {
        match self {
            Per::Day => "day",
            Per::Month => "month",
        }
    }
}

/// A quota: its period, time zone and limits (at least one of calls and rows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quota {
    pub per: Per,
    /// An IANA zone name, e.g. `Europe/Berlin` or `UTC`.
    pub zone: String,
    pub calls: Option<u64>,
    pub rows: Option<u64>,
}

/// QAG.QUOTA's answer, with the limits it was checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuotaDecision {
    pub allowed: bool,
    pub calls_limit: Option<u64>,
    pub calls_remaining: Option<u64>,
    pub rows_limit: Option<u64>,
    pub rows_remaining: Option<u64>,
    /// The period's end, in Unix seconds.
    pub resets_at: i64,
    pub answered_by: AnsweredBy,
}

/// QAG.QUOTA.ADD's and QAG.QUOTA.SEED's answer: the period's counts after the call
/// (0 when forwarded: nothing was counted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuotaUsage {
    pub calls: u64,
    pub rows: u64,
    pub resets_at: i64,
    pub answered_by: AnsweredBy,
}

/// One scope of a sliding-window chain: its key and limits (0: no limit of that kind).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    pub key: String,
    pub rpm: u64,
    pub tpm: u64,
}

/// QAG.ADMIT's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    pub admitted: bool,
    /// The 0-based index of the scope that refused.
    pub refused_by: Option<usize>,
    pub retry_after: RetryAfter,
    /// The least requests left over the scopes that limit requests; None when none does.
    pub requests_remaining: Option<u64>,
    /// The same for tokens.
    pub tokens_remaining: Option<u64>,
    pub answered_by: AnsweredBy,
}

/// QAG.RECORD's answer: how many scopes were charged (0 when forwarded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recorded {
    pub charged: u64,
    pub answered_by: AnsweredBy,
}

/// A lease that could not be taken: every slot is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseRefusal {
    /// Live leases on the key.
    pub live: u64,
    /// Before asking again (1 s: leases are released at any time).
    pub retry_after: RetryAfter,
    pub answered_by: AnsweredBy,
    /// How long the call waited for a slot before it was refused (`Limiter::with_wait`).
    pub waited: Duration,
}

fn non_negative(value: i64, what: &str) -> Result<u64, String> {
    u64::try_from(value).map_err(|_| format!("{what} must not be negative, got {value}"))
}

/// `-1` stands for "no limit of this kind" in QAG.ADMIT's reply.
fn remaining_or_unlimited(value: i64) -> Result<Option<u64>, String> {
    match value {
        -1 => Ok(None),
        n => non_negative(n, "remaining").map(Some),
    }
}

impl QuotaDecision {
    /// From QAG.QUOTA's reply `[allowed, calls left|nil, rows left|nil, resets_at]`.
    pub fn from_reply(reply: &[Option<i64>], quota: &Quota) -> Result<QuotaDecision, String> {
        match *reply {
            [Some(allowed @ (0 | 1)), calls, rows, Some(resets_at)] => Ok(QuotaDecision {
                allowed: allowed == 1,
                calls_limit: quota.calls,
                calls_remaining: calls.map(|n| non_negative(n, "calls")).transpose()?,
                rows_limit: quota.rows,
                rows_remaining: rows.map(|n| non_negative(n, "rows")).transpose()?,
                resets_at,
                answered_by: AnsweredBy::Module,
            }),
            _ => Err(format!("a QAG.QUOTA reply, got {reply:?}")),
        }
    }

    /// The check as it stands after the call's counts were added: what remains is
    /// rendered from the usage QAG.QUOTA.ADD answered, so the last call the quota
    /// allows reports 0 left. A forwarded usage (nothing counted) changes nothing.
    pub fn after_add(&self, usage: &QuotaUsage) -> QuotaDecision {
        if usage.answered_by == AnsweredBy::Forwarded {
            return *self;
        }
        let left = |limit: Option<u64>, used: u64| limit.map(|limit| limit.saturating_sub(used));
        QuotaDecision {
            calls_remaining: left(self.calls_limit, usage.calls),
            rows_remaining: left(self.rows_limit, usage.rows),
            resets_at: usage.resets_at,
            ..*self
        }
    }
}

impl QuotaUsage {
    pub fn from_reply(reply: &[i64]) -> Result<QuotaUsage, String> {
        match *reply {
            [calls, rows, resets_at] => Ok(QuotaUsage {
                calls: non_negative(calls, "calls")?,
                rows: non_negative(rows, "rows")?,
                resets_at,
                answered_by: AnsweredBy::Module,
            }),
            _ => Err(format!("a QAG.QUOTA.ADD reply, got {reply:?}")),
        }
    }
}

impl Admission {
    pub fn from_reply(reply: &[i64]) -> Result<Admission, String> {
        match *reply {
            [admitted @ (0 | 1), scope, retry, requests, tokens] => Ok(Admission {
                admitted: admitted == 1,
                refused_by: match non_negative(scope, "scope")? {
                    0 => None,
                    n => Some(n as usize - 1),
                },
                retry_after: RetryAfter::Seconds(non_negative(retry, "retry_after")?),
                requests_remaining: remaining_or_unlimited(requests)?,
                tokens_remaining: remaining_or_unlimited(tokens)?,
                answered_by: AnsweredBy::Module,
            }),
            _ => Err(format!("a QAG.ADMIT reply, got {reply:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(reply: [i64; 3]) -> Decision {
        Decision::from_reply(&reply, 60, 60.0, AnsweredBy::Module).unwrap()
    }

    #[test]
    fn bucket_replies() {
        let allowed = decision([1, 59, 0]);
        assert!(allowed.allowed);
        assert_eq!(
            (allowed.remaining, allowed.retry_after),
            (59, RetryAfter::Seconds(0))
        );
        let never = decision([0, 59, -1]);
        assert_eq!(never.retry_after, RetryAfter::Never);
        for bad in [[2, 1, 0], [1, -1, 0], [0, 1, -2]] {
            assert!(Decision::from_reply(&bad, 60, 60.0, AnsweredBy::Script).is_err());
        }
        assert!(Decision::from_reply(&[1, 2], 60, 60.0, AnsweredBy::Script).is_err());
    }

    #[test]
    fn seconds_to_full_counts_the_missing_whole_tokens() {
        assert_eq!(decision([1, 60, 0]).seconds_to_full(), 0);
        assert_eq!(decision([1, 59, 0]).seconds_to_full(), 1);
        let slow = Decision::from_reply(&[1, 7, 0], 10, 3600.0, AnsweredBy::Module).unwrap();
        assert_eq!(slow.seconds_to_full(), 1080);
        let fast = Decision::from_reply(&[0, 0, 1], 10, 0.5, AnsweredBy::Module).unwrap();
        assert_eq!(fast.seconds_to_full(), 1);
    }

    #[test]
    fn a_pair_names_the_bucket_that_refused() {
        let client_refused = PairDecision {
            client: decision([0, 0, 4]),
            key: None,
        };
        assert!(!client_refused.allowed());
        assert_eq!(client_refused.refused_by(), Some(Side::Client));
        assert_eq!(client_refused.retry_after(), RetryAfter::Seconds(4));
        let key_refused = PairDecision {
            client: decision([1, 5, 0]),
            key: Some(decision([0, 0, 9])),
        };
        assert_eq!(key_refused.refused_by(), Some(Side::Key));
        assert_eq!(key_refused.retry_after(), RetryAfter::Seconds(9));
        let allowed = PairDecision {
            client: decision([1, 5, 0]),
            key: Some(decision([1, 3, 0])),
        };
        assert!(allowed.allowed());
        assert_eq!(
            (allowed.refused_by(), allowed.retry_after()),
            (None, RetryAfter::Seconds(0))
        );
    }

    #[test]
    fn quota_and_window_replies() {
        let quota = Quota {
            per: Per::Month,
            zone: "UTC".into(),
            calls: Some(100),
            rows: None,
        };
        let decision =
            QuotaDecision::from_reply(&[Some(1), Some(99), None, Some(1_800_000_000)], &quota)
                .unwrap();
        assert_eq!(decision.calls_remaining, Some(99));
        assert_eq!(decision.rows_remaining, None);
        assert_eq!(decision.calls_limit, Some(100));
        assert!(QuotaDecision::from_reply(&[Some(1), Some(-1), None, Some(0)], &quota).is_err());
        assert_eq!(
            QuotaUsage::from_reply(&[3, 250, 7]).unwrap(),
            QuotaUsage {
                calls: 3,
                rows: 250,
                resets_at: 7,
                answered_by: AnsweredBy::Module,
            }
        );
        let after = decision.after_add(&QuotaUsage {
            calls: 100,
            rows: 5,
            resets_at: 9,
            answered_by: AnsweredBy::Module,
        });
        assert_eq!(
            (after.calls_remaining, after.rows_remaining),
            (Some(0), None)
        );
        assert_eq!((after.allowed, after.resets_at), (true, 9));
        let refused = Admission::from_reply(&[0, 2, 13, 0, -1]).unwrap();
        assert_eq!(refused.refused_by, Some(1));
        assert_eq!(refused.requests_remaining, Some(0));
        assert_eq!(refused.tokens_remaining, None);
        assert_eq!(
            Admission::from_reply(&[1, 0, 0, 5, 7]).unwrap().refused_by,
            None
        );
        assert!(Admission::from_reply(&[1, 0, 0, 5]).is_err());
    }
}
