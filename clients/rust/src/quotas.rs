//! Calendar quotas: QAG.QUOTA before a call, QAG.QUOTA.ADD after it, QAG.QUOTA.SEED from
//! the gateway's durable store (module only), and the answers of the outage policy.
//! Every count Redis answers is remembered, so that local decisions during an outage
//! start from it.

use qag_core::quota::{self, QuotaArgs, Usage};
use redis::aio::ConnectionLike;

use crate::decision::{AnsweredBy, Quota, QuotaDecision, QuotaUsage};
use crate::error::Error;
use crate::limiter::{check, command, unix_micros, Answer, Instead, Limiter};
use crate::mutex::lock;

impl Answer for QuotaDecision {
    fn answered_by(&self) -> Option<AnsweredBy> {
        Some(self.answered_by)
    }
}

impl Answer for QuotaUsage {
    fn answered_by(&self) -> Option<AnsweredBy> {
        Some(self.answered_by)
    }
}

fn quota_words(name: &str, key: &str, quota: &Quota) -> Vec<String> {
    vec![
        name.to_owned(),
        key.to_owned(),
        "PER".into(),
        quota.per.as_str().into(),
        "TZ".into(),
        quota.zone.clone(),
    ]
}

/// The end of the period of `now_micros` (Unix seconds), as the module computes it.
fn period_end(args: &QuotaArgs, now_micros: i64) -> i64 {
    quota::period(args.per, &args.zone, now_micros).map_or(0, |period| period.end)
}

fn as_count(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// A quota's check (QAG.QUOTA, which counts nothing), its words checked by the module's
/// own parser, and what the policy answers for it.
pub(crate) struct QuotaCheck<'a> {
    key: &'a str,
    quota: &'a Quota,
    words: Vec<String>,
    args: QuotaArgs,
}

impl<'a> QuotaCheck<'a> {
    pub(crate) fn new(key: &'a str, quota: &'a Quota) -> Result<QuotaCheck<'a>, Error> {
        let mut words = quota_words("QAG.QUOTA", key, quota);
        for (name, limit) in [("CALLS", quota.calls), ("ROWS", quota.rows)] {
            if let Some(limit) = limit {
                words.extend([name.to_owned(), limit.to_string()]);
            }
        }
        let args = check(|words| quota::parse_quota(words, true), &words)?;
        Ok(QuotaCheck {
            key,
            quota,
            words,
            args,
        })
    }

    pub(crate) fn command(&self) -> redis::Cmd {
        command(&self.words)
    }

    /// The check when Redis is left alone: allowed with nothing known (forwarded), or
    /// from this process's counts (local).
    pub(crate) fn instead(&self, instead: Instead<'_>) -> QuotaDecision {
        let quota = self.quota;
        match instead {
            Instead::Forward => QuotaDecision {
                allowed: true,
                calls_limit: quota.calls,
                calls_remaining: None,
                rows_limit: quota.rows,
                rows_remaining: None,
                resets_at: period_end(&self.args, unix_micros()),
                answered_by: AnsweredBy::Forwarded,
            },
            Instead::Local {
                state,
                now_micros,
                share,
            } => {
                let resets_at = period_end(&self.args, now_micros);
                let local = state
                    .quotas
                    .check(self.key, self.args.limits(), resets_at, share);
                QuotaDecision {
                    allowed: local.allowed,
                    calls_limit: quota.calls,
                    calls_remaining: local.calls_remaining,
                    rows_limit: quota.rows,
                    rows_remaining: local.rows_remaining,
                    resets_at,
                    answered_by: AnsweredBy::Local,
                }
            }
        }
    }
}

impl<C> Limiter<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The check before a call: whether `quota` allows one more. Module only.
    pub async fn quota_check(&self, key: &str, quota: &Quota) -> Result<QuotaDecision, Error> {
        let this = &self.for_keys(&[key]).await?;
        let check = QuotaCheck::new(key, quota)?;
        this.run(this.quota_check_remote(&check), |instead| {
            Some(check.instead(instead))
        })
        .await
    }

    /// The check's call to Redis.
    pub(crate) async fn quota_check_remote(
        &self,
        check: &QuotaCheck<'_>,
    ) -> Result<QuotaDecision, Error> {
        let reply = self.module_call_replayable(&check.command()).await?;
        self.quota_checked(check, reply)
    }

    /// QAG.QUOTA's reply as a decision, noted as Redis's last word on the quota (where
    /// local counting would begin).
    pub(crate) fn quota_checked(
        &self,
        check: &QuotaCheck<'_>,
        reply: Vec<Option<i64>>,
    ) -> Result<QuotaDecision, Error> {
        let decision = QuotaDecision::from_reply(&reply, check.quota)
            .map_err(|why| Error::Server(why.into()))?;
        let used =
            |limit: Option<u64>, left: Option<u64>| Some(as_count(limit?.saturating_sub(left?)));
        lock(&self.node.local).quotas.saw(
            check.key,
            used(decision.calls_limit, decision.calls_remaining),
            used(decision.rows_limit, decision.rows_remaining),
            decision.resets_at,
            unix_micros() / 1_000_000,
        );
        Ok(decision)
    }

    /// The count after a call: adds `calls` and `rows` to `quota`'s current period.
    /// Replayable: sent with an id, once more after a dropped connection.
    pub async fn quota_add(
        &self,
        key: &str,
        quota: &Quota,
        calls: u64,
        rows: u64,
    ) -> Result<QuotaUsage, Error> {
        self.quota_count("QAG.QUOTA.ADD", key, quota, calls, rows)
            .await
    }

    /// Seeds the current period from the gateway's durable store (each count becomes
    /// the larger of Redis's and the seed).
    pub async fn quota_seed(
        &self,
        key: &str,
        quota: &Quota,
        calls: u64,
        rows: u64,
    ) -> Result<QuotaUsage, Error> {
        self.quota_count("QAG.QUOTA.SEED", key, quota, calls, rows)
            .await
    }

    async fn quota_count(
        &self,
        command_name: &str,
        key: &str,
        quota: &Quota,
        calls: u64,
        rows: u64,
    ) -> Result<QuotaUsage, Error> {
        let this = &self.for_keys(&[key]).await?;
        let mut words = quota_words(command_name, key, quota);
        words.extend([
            "CALLS".into(),
            calls.to_string(),
            "ROWS".into(),
            rows.to_string(),
        ]);
        // An add counts, so it carries an id and is replayed; a seed counts the same
        // however often it runs.
        let seed = command_name == "QAG.QUOTA.SEED";
        if !seed {
            words.extend(["ID".into(), this.call_id()]);
        }
        let args = check(|words| quota::parse_quota(words, true), &words)?;
        let remote = async {
            let reply: Vec<i64> = if seed {
                this.module_call(&command(&words)).await?
            } else {
                this.spend_call(&words, this.request_id().is_none()).await?
            };
            let usage = QuotaUsage::from_reply(&reply).map_err(|why| Error::Server(why.into()))?;
            lock(&this.node.local).quotas.saw(
                key,
                Some(as_count(usage.calls)),
                Some(as_count(usage.rows)),
                usage.resets_at,
                unix_micros() / 1_000_000,
            );
            Ok(usage)
        };
        this.run(remote, |instead| {
            Some(match instead {
                Instead::Forward => QuotaUsage {
                    calls: 0,
                    rows: 0,
                    resets_at: period_end(&args, unix_micros()),
                    answered_by: AnsweredBy::Forwarded,
                },
                Instead::Local {
                    state, now_micros, ..
                } => {
                    let resets_at = period_end(&args, now_micros);
                    let counts = Usage {
                        calls: as_count(calls),
                        rows: as_count(rows),
                    };
                    let used = state.quotas.add(key, counts, seed, resets_at);
                    QuotaUsage {
                        calls: used.calls.max(0) as u64,
                        rows: used.rows.max(0) as u64,
                        resets_at,
                        answered_by: AnsweredBy::Local,
                    }
                }
            })
        })
        .await
    }
}
