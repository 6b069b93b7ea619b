//! Calendar quotas: QAG.QUOTA before a call, QAG.QUOTA.ADD after it, QAG.QUOTA.SEED from
//! the gateway's durable store (or `lua/quota.lua` where the module is not: given the
//! calendar period computed here with the module's own code), and the answers of the
//! outage policy. Every count Redis answers is remembered, so that local decisions
//! during an outage start from it.

use qag_core::quota::{self, QuotaArgs, Usage};
use redis::aio::ConnectionLike;
use redis::{FromRedisValue, Value};

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

/// What lua/quota.lua is given of the calendar for the clock `now_micros`: the period's
/// label, start and end, and the next period's label and end (counted into when the key
/// holds it), as the module computes them.
fn period_words(args: &QuotaArgs, now_micros: i64) -> Result<[String; 5], Error> {
    let outside = || Error::Server("ERR the server clock is outside the calendar's range".into());
    let current = quota::period(args.per, &args.zone, now_micros).ok_or_else(outside)?;
    let next_start = current.end.saturating_mul(1_000_000);
    let next = quota::period(args.per, &args.zone, next_start).ok_or_else(outside)?;
    Ok([
        current.label.as_str().to_owned(),
        current.start.to_string(),
        current.end.to_string(),
        next.label.as_str().to_owned(),
        next.end.to_string(),
    ])
}

/// The server's clock (Unix microseconds) in the script's answer to a period that is not
/// the server's: `["period", seconds, microseconds]`.
fn server_clock(reply: &Value) -> Option<i64> {
    let Value::Array(parts) = reply else {
        return None;
    };
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?.parse::<i64>().ok(),
        _ => None,
    };
    match &parts[..] {
        [Value::BulkString(word), seconds, micros] if word == b"period" => {
            Some(text(seconds)?.checked_mul(1_000_000)? + text(micros)?)
        }
        _ => None,
    }
}

/// How often a quota call is sent to the script with the period of the server's clock
/// it answered: once is the rule; a period that ended meanwhile takes one more.
const PERIOD_TRIES: usize = 3;

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

    /// The limits as lua/quota.lua takes them: each a number, or "" for none.
    fn script_limits(&self) -> [String; 2] {
        [self.quota.calls, self.quota.rows]
            .map(|limit| limit.map_or(String::new(), |l| l.to_string()))
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
    /// lua/quota.lua's `op` on `key`, given the calendar period of this process's clock
    /// and then `tail`; where that period is not the server's (a period ended between
    /// the two clocks), the script answers the server's clock, and is sent again with
    /// that clock's period: the server's, as the module's.
    async fn quota_by_script<T: FromRedisValue>(
        &self,
        key: &str,
        args: &QuotaArgs,
        op: &str,
        tail: &[String],
        replayable: bool,
    ) -> Result<T, Error> {
        let mut clock = unix_micros();
        for _ in 0..PERIOD_TRIES {
            let mut script = self.shared.quota_script.key(key);
            script
                .arg(op)
                .arg(&period_words(args, clock)?[..])
                .arg(tail);
            let reply: Value = self.script_reply(&script, replayable).await?;
            match server_clock(&reply) {
                Some(server) => clock = server,
                None => {
                    return T::from_redis_value(reply)
                        .map_err(|error| Error::Server(format!("a quota reply: {error}").into()))
                }
            }
        }
        Err(Error::Server(
            "the server's clock left every calendar period it was given".into(),
        ))
    }

    /// The check before a call: whether `quota` allows one more.
    pub async fn quota_check(&self, key: &str, quota: &Quota) -> Result<QuotaDecision, Error> {
        let this = &self.for_keys(&[key]).await?;
        let check = QuotaCheck::new(key, quota)?;
        this.run(this.quota_check_remote(&check), |instead| {
            Some(check.instead(instead))
        })
        .await
    }

    /// The check's call to Redis: the module's QAG.QUOTA, or lua/quota.lua.
    pub(crate) async fn quota_check_remote(
        &self,
        check: &QuotaCheck<'_>,
    ) -> Result<QuotaDecision, Error> {
        if let Some(reply) = self.module_reply(&check.command(), true).await? {
            return self.quota_checked(check, reply, AnsweredBy::Module);
        }
        let limits = check.script_limits();
        let reply = self
            .quota_by_script(check.key, &check.args, "check", &limits, true)
            .await?;
        self.quota_checked(check, reply, AnsweredBy::Script)
    }

    /// A check's reply (the module's or the script's) as a decision, noted as Redis's
    /// last word on the quota (where local counting would begin).
    pub(crate) fn quota_checked(
        &self,
        check: &QuotaCheck<'_>,
        reply: Vec<Option<i64>>,
        answered_by: AnsweredBy,
    ) -> Result<QuotaDecision, Error> {
        let decision = QuotaDecision {
            answered_by,
            ..QuotaDecision::from_reply(&reply, check.quota)
                .map_err(|why| Error::Server(why.into()))?
        };
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
        let id = (!seed).then(|| this.call_id());
        if let Some(id) = &id {
            words.extend(["ID".into(), id.clone()]);
        }
        let args = check(|words| quota::parse_quota(words, true), &words)?;
        let own_id = this.request_id().is_none();
        let remote = async {
            let module = match seed {
                true => this.module_reply(&command(&words), false).await?,
                false => this.spend_call(&words, own_id).await?,
            };
            let (reply, answered_by) = match module {
                Some(reply) => (reply, AnsweredBy::Module),
                None => {
                    let mut tail = vec![calls.to_string(), rows.to_string()];
                    let op = match &id {
                        Some(id) => {
                            let keep = own_id.then(|| this.own_keep().to_string());
                            tail.extend([id.clone(), keep.unwrap_or_default()]);
                            "add"
                        }
                        None => "seed",
                    };
                    let reply: Vec<i64> =
                        this.quota_by_script(key, &args, op, &tail, !seed).await?;
                    (reply, AnsweredBy::Script)
                }
            };
            let usage = QuotaUsage {
                answered_by,
                ..QuotaUsage::from_reply(&reply).map_err(|why| Error::Server(why.into()))?
            };
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
                    let now = now_micros.div_euclid(1_000_000);
                    let used = state.quotas.add(key, counts, seed, resets_at, now);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_is_given_the_period_and_the_next() {
        let words = [
            "QAG.QUOTA",
            "k",
            "PER",
            "day",
            "TZ",
            "Europe/Berlin",
            "CALLS",
            "1",
        ];
        let args = check(|words| quota::parse_quota(words, true), &words).unwrap();
        // 2026-03-28 12:00 in Berlin: the next day is 23 hours long (the clocks go forward).
        let now = 1_774_695_600 * 1_000_000;
        assert_eq!(
            period_words(&args, now).unwrap(),
            [
                "2026-03-28",
                "1774652400",
                "1774738800",
                "2026-03-29",
                "1774821600"
            ]
        );
    }

    #[test]
    fn a_period_refused_names_the_server_clock() {
        let bulk = |text: &str| Value::BulkString(text.as_bytes().to_vec());
        let refused = Value::Array(vec![bulk("period"), bulk("1796320454"), bulk("78")]);
        assert_eq!(server_clock(&refused), Some(1_796_320_454_000_078));
        for other in [
            Value::Array(vec![Value::Int(1), Value::Int(2), Value::Int(3)]),
            Value::Array(vec![bulk("period"), bulk("x"), bulk("1")]),
            Value::Array(vec![bulk("other"), bulk("1"), bulk("1")]),
            Value::Int(1),
        ] {
            assert_eq!(server_clock(&other), None, "{other:?}");
        }
    }
}
