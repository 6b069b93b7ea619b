//! Token buckets: QAG.TAKE, QAG.TAKE2 and QAG.PEEK where the module is, the script (and
//! a read for PEEK) where it is not, and the answers of the outage policy.

use std::time::{Duration, Instant};

use qag_core::bucket::{self, Limit, TakeArgs};
use redis::aio::ConnectionLike;
use redis::{cmd, Cmd, RedisError, RedisResult, ServerErrorKind, Value};

use crate::cluster::slot_of;
use crate::decision::{
    AnsweredBy, Decision, PairDecision, Quota, Refunded, RetryAfter, TakenWithQuota,
};
use crate::error::{classify, Error, Failure};
use crate::limiter::{check, failure_error, unix_micros, Answer, Instead, Limiter, Path};
use crate::local::{share_of, LocalBuckets};
use crate::mutex::lock;
use crate::naming::Bucket;
use crate::quotas::QuotaCheck;
use crate::CrossSlot;

impl Answer for Decision {
    fn answered_by(&self) -> Option<AnsweredBy> {
        Some(self.answered_by)
    }
}

impl Answer for Refunded {
    fn answered_by(&self) -> Option<AnsweredBy> {
        Some(self.answered_by)
    }
}

impl Answer for PairDecision {
    fn answered_by(&self) -> Option<AnsweredBy> {
        Some(self.client.answered_by)
    }
}

impl Answer for TakenWithQuota {
    fn answered_by(&self) -> Option<AnsweredBy> {
        self.client
            .or(self.key)
            .map(|decision| decision.answered_by)
    }
}

/// A bucket call's arguments, checked by the module's own parser.
struct BucketCall {
    key: String,
    args: TakeArgs,
    count: u64,
    period: f64,
    period_text: String,
    cost: u64,
}

impl BucketCall {
    fn new(bucket: &Bucket, cost: u64) -> Result<BucketCall, Error> {
        let (key, count, period) = (bucket.key(), bucket.count(), bucket.period());
        let period_text = number_text(period);
        let (count_text, cost_text) = (count.to_string(), cost.to_string());
        let words = [
            "QAG.TAKE",
            key,
            &count_text,
            &period_text,
            "COST",
            &cost_text,
        ];
        let args = check(|words| bucket::parse_take(words, true), &words)?;
        Ok(BucketCall {
            key: key.to_owned(),
            args,
            count,
            period,
            period_text,
            cost,
        })
    }

    fn decision(&self, reply: &[i64], answered_by: AnsweredBy) -> Result<Decision, Error> {
        Decision::from_reply(reply, self.count, self.period, answered_by)
            .map_err(|why| Error::Server(why.into()))
    }

    /// Not counted: the caller lets the request through.
    fn forwarded(&self) -> Decision {
        Decision {
            allowed: true,
            limit: self.count,
            period: self.period,
            remaining: self.count,
            retry_after: RetryAfter::Seconds(0),
            answered_by: AnsweredBy::Forwarded,
            waited: Duration::ZERO,
        }
    }

    /// This process's part of the bucket: its share of the count, refilled in the same
    /// period.
    fn local_limit(&self, share: f64) -> Limit {
        Limit {
            count: share_of(self.count, share) as f64,
            period: self.args.limit.period,
        }
    }

    fn local_decision(&self, verdict: bucket::Verdict) -> Decision {
        Decision {
            allowed: verdict.allowed,
            limit: self.count,
            period: self.period,
            remaining: verdict.tokens_left.max(0) as u64,
            retry_after: RetryAfter::from_reply(verdict.retry_after).unwrap_or(RetryAfter::Never),
            answered_by: AnsweredBy::Local,
            waited: Duration::ZERO,
        }
    }

    fn take_locally(&self, buckets: &mut LocalBuckets, share: f64, now: f64) -> Decision {
        let verdict = buckets.take(&self.key, self.local_limit(share), self.args.cost, now);
        self.local_decision(verdict)
    }

    fn command(&self, name: &str) -> Cmd {
        let mut command = cmd(name);
        command
            .arg(&self.key)
            .arg(self.count)
            .arg(&self.period_text);
        push_cost(&mut command, self.cost);
        command
    }

    /// QAG.TAKE, with the caller's id as its last option if it has one.
    fn take_command(&self, id: Option<&str>) -> Cmd {
        let mut command = self.command("QAG.TAKE");
        push_id(&mut command, id);
        command
    }
}

/// QAG.TAKE2 on both buckets, with the caller's id as its last option if it has one.
fn pair_command(client: &BucketCall, key: &BucketCall, id: Option<&str>) -> Cmd {
    let mut command = cmd("QAG.TAKE2");
    command
        .arg(&client.key)
        .arg(client.count)
        .arg(&client.period_text)
        .arg(&key.key)
        .arg(key.count)
        .arg(&key.period_text);
    push_cost(&mut command, client.cost);
    push_id(&mut command, id);
    command
}

/// A pipeline's replies with an error reply kept in its place, but those about where to
/// send it returned as the round trip's error, so the round trip goes where a single
/// command would: READONLY (a demoted primary ran nothing: sent again), and, for a
/// waiting call on a cluster, MOVED, ASK and TRYAGAIN (followed; the shared
/// connections' router follows them itself).
fn connection_errors_surfaced(replies: RedisResult<Vec<Value>>) -> RedisResult<Vec<Value>> {
    let replies = replies?;
    for reply in &replies {
        if let Value::ServerError(error) = reply {
            if matches!(
                error.kind(),
                Some(
                    ServerErrorKind::ReadOnly
                        | ServerErrorKind::Moved
                        | ServerErrorKind::Ask
                        | ServerErrorKind::TryAgain
                )
            ) {
                return Err(RedisError::from(error.clone()));
            }
        }
    }
    Ok(replies)
}

/// One reply of a pipeline as `T`, or the error it is.
fn pipelined<T: redis::FromRedisValue>(reply: Value) -> Result<T, Failure> {
    if let Value::ServerError(error) = reply {
        return Err(classify(&RedisError::from(error)));
    }
    redis::from_redis_value(reply)
        .map_err(|error| Failure::Error(Error::Server(error.to_string().into())))
}

/// A number as the module and the script read it back: the shortest exact decimal.
fn number_text(value: f64) -> String {
    if value.is_finite() {
        qag_core::number::format_number(&mut qag_core::number::NumberBuffer::new(), value)
            .to_owned()
    } else {
        // Refused by the parser with the module's message.
        value.to_string()
    }
}

/// `ID id`, the last option, when the call has the caller's id.
fn push_id(command: &mut Cmd, id: Option<&str>) {
    if let Some(id) = id {
        command.arg("ID").arg(id);
    }
}

/// A bucket script's id and KEEP (none: "") after its other arguments, for the script
/// that remembers it (`Limiter::bucket_script`).
fn push_script_id(invocation: &mut redis::ScriptInvocation<'_>, id: Option<&str>) {
    if let Some(id) = id {
        invocation.arg(id).arg("");
    }
}

/// `COST n`, left out for the default 1 (less for the server to read).
fn push_cost(command: &mut Cmd, cost: u64) {
    if cost != 1 {
        command.arg("COST").arg(cost);
    }
}

fn seconds(now_micros: i64) -> f64 {
    bucket::seconds_from_micros(now_micros)
}

impl<C> Limiter<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Takes `cost` tokens from `bucket`. Sent once more after a dropped connection:
    /// with the caller's id ([`Limiter::with_id`]) it counts once; without (the
    /// default: an admission sends no id of the limiter's, which would cost the key
    /// memory and the server CPU), a first call that ran is charged again, erring
    /// stricter by one token, never granting more.
    pub async fn take(&self, bucket: &Bucket, cost: u64) -> Result<Decision, Error> {
        let this = &self.for_keys(&[bucket.key()]).await?;
        let call = BucketCall::new(bucket, cost)?;
        this.run(this.take_remote(&call, this.request_id()), |instead| {
            Some(match instead {
                Instead::Forward => call.forwarded(),
                Instead::Local {
                    state,
                    now_micros,
                    share,
                } => call.take_locally(&mut state.buckets, share, seconds(now_micros)),
            })
        })
        .await
    }

    /// Both buckets of a request: the client's, then, only if it allowed, the key's;
    /// `cost` from each. QAG.TAKE2 where the module is, else its script on both keys,
    /// either atomic in one round trip (both keys must be in one cluster slot). Replayed
    /// as [`Limiter::take`] is.
    pub async fn take_pair(
        &self,
        client: &Bucket,
        key: &Bucket,
        cost: u64,
    ) -> Result<PairDecision, Error> {
        let started = Instant::now();
        if self.on_cluster().await
            && slot_of(client.key().as_bytes()) != slot_of(key.key().as_bytes())
        {
            return match self.options.cross_slot {
                CrossSlot::Error => Err(Error::CrossSlot(format!(
                    "the buckets {} and {} are in different cluster slots: give both a common \
                     hash tag (bucket_key(.., Some(tag))), or choose CrossSlot::TwoCalls",
                    client.key(),
                    key.key()
                ))),
                CrossSlot::TwoCalls => self.take_pair_in_two_calls(client, key, cost).await,
            };
        }
        let this = &self
            .for_keys_from(&[client.key(), key.key()], started)
            .await?;
        let client = BucketCall::new(client, cost)?;
        let key = BucketCall::new(key, cost)?;
        this.run(
            this.take_pair_remote(&client, &key, this.request_id()),
            |instead| {
                Some(match instead {
                    Instead::Forward => PairDecision {
                        client: client.forwarded(),
                        key: Some(key.forwarded()),
                    },
                    Instead::Local {
                        state,
                        now_micros,
                        share,
                    } => {
                        let now = seconds(now_micros);
                        let buckets = &mut state.buckets;
                        let client = client.take_locally(buckets, share, now);
                        let key = client
                            .allowed
                            .then(|| key.take_locally(buckets, share, now));
                        PairDecision { client, key }
                    }
                })
            },
        )
        .await
    }

    /// A request's buckets (the client's and the key's, either or both: QAG.TAKE2, or
    /// QAG.TAKE for one) and its quota's check (QAG.QUOTA, which counts nothing), sent
    /// together in one round trip where they can share one: the module on a single
    /// server, or every key in one cluster slot. Otherwise (no module: the script; keys
    /// of several slots) the buckets are taken, then the quota read. Either way the
    /// quota is read even when a bucket refused, so a refusal can show what is left of
    /// the quota; a refused call is never counted in it (that is QAG.QUOTA.ADD's, after
    /// the call). An outage of the round trip is answered by the policy for both; a
    /// check that fails on its own (an error reply, or its own round trip failing) is
    /// [`TakenWithQuota::quota`]'s error, the buckets' decisions standing.
    pub async fn take_with_quota(
        &self,
        client: Option<&Bucket>,
        key: Option<&Bucket>,
        cost: u64,
        quota_key: &str,
        quota: &Quota,
    ) -> Result<TakenWithQuota, Error> {
        let started = Instant::now();
        let check = QuotaCheck::new(quota_key, quota)?;
        let buckets: Vec<&Bucket> = client.into_iter().chain(key).collect();
        if buckets.is_empty() {
            let quota = self.quota_check(quota_key, quota).await?;
            return Ok(TakenWithQuota {
                client: None,
                key: None,
                quota: Ok(quota),
            });
        }
        let slot = slot_of(quota_key.as_bytes());
        let one_slot = buckets
            .iter()
            .all(|bucket| slot_of(bucket.key().as_bytes()) == slot);
        if !one_slot && self.on_cluster().await {
            let (client, key) = match (client, key) {
                (Some(client), Some(key)) => {
                    let pair = self.take_pair(client, key, cost).await?;
                    (Some(pair.client), pair.key)
                }
                (Some(client), None) => (Some(self.take(client, cost).await?), None),
                (None, Some(key)) => (None, Some(self.take(key, cost).await?)),
                (None, None) => (None, None),
            };
            let quota = self.quota_check(quota_key, quota).await;
            return Ok(TakenWithQuota { client, key, quota });
        }
        let mut keys: Vec<&str> = buckets.iter().map(|bucket| bucket.key()).collect();
        keys.push(quota_key);
        let this = &self.for_keys_from(&keys, started).await?;
        let client = client
            .map(|bucket| BucketCall::new(bucket, cost))
            .transpose()?;
        let key = key
            .map(|bucket| BucketCall::new(bucket, cost))
            .transpose()?;
        let remote = this.take_with_quota_remote(client.as_ref(), key.as_ref(), &check);
        this.run(remote, |instead| {
            Some(match instead {
                Instead::Forward => TakenWithQuota {
                    client: client.as_ref().map(BucketCall::forwarded),
                    key: key.as_ref().map(BucketCall::forwarded),
                    quota: Ok(check.instead(Instead::Forward)),
                },
                Instead::Local {
                    state,
                    now_micros,
                    share,
                } => {
                    let now = seconds(now_micros);
                    let buckets = &mut state.buckets;
                    let client = client
                        .as_ref()
                        .map(|call| call.take_locally(buckets, share, now));
                    let key = match client {
                        Some(refused) if !refused.allowed => None,
                        _ => key
                            .as_ref()
                            .map(|call| call.take_locally(buckets, share, now)),
                    };
                    let quota = check.instead(Instead::Local {
                        state,
                        now_micros,
                        share,
                    });
                    TakenWithQuota {
                        client,
                        key,
                        quota: Ok(quota),
                    }
                }
            })
        })
        .await
    }

    async fn take_with_quota_remote(
        &self,
        client: Option<&BucketCall>,
        key: Option<&BucketCall>,
        check: &QuotaCheck<'_>,
    ) -> Result<TakenWithQuota, Error> {
        let id = self.request_id();
        let mut take = match (client, key) {
            (Some(client), Some(key)) => pair_command(client, key, id),
            (Some(call), None) | (None, Some(call)) => call.take_command(id),
            (None, None) => {
                let quota = self.quota_check_remote(check).await?;
                return Ok(TakenWithQuota {
                    client: None,
                    key: None,
                    quota: Ok(quota),
                });
            }
        };
        if self.path().await? == Path::Module {
            self.wait_words(&mut take);
            let mut pipe = redis::pipe();
            pipe.add_command(take)
                .add_command(check.command())
                .ignore_errors();
            let pipe = &pipe;
            // Replayed as an admission and a read are (but for a wait).
            let sent = self.sent_waiting(
                |mut con| async move {
                    connection_errors_surfaced(pipe.query_async::<Vec<Value>>(&mut con).await)
                },
                true,
            );
            let mut replies = sent.await.map_err(failure_error)?.into_iter();
            let (Some(taken), Some(quota)) = (replies.next(), replies.next()) else {
                return Err(Error::Server("a pipeline of two replies, got fewer".into()));
            };
            let decided = match (client, key) {
                (Some(client), Some(key)) => pipelined(taken).and_then(|reply| {
                    let pair = self.pair_decided(client, key, reply, AnsweredBy::Module);
                    let pair = pair.map_err(Failure::Error)?;
                    Ok((Some(pair.client), pair.key))
                }),
                (Some(call), None) | (None, Some(call)) => {
                    pipelined::<Vec<i64>>(taken).and_then(|reply| {
                        let decision = self.decided(call, &reply, AnsweredBy::Module);
                        let decision = Some(decision.map_err(Failure::Error)?);
                        Ok(match client {
                            Some(_) => (decision, None),
                            None => (None, decision),
                        })
                    })
                }
                (None, None) => Ok((None, None)),
            };
            match decided {
                Ok((client, key)) => {
                    let quota = pipelined(quota)
                        .map_err(failure_error)
                        .and_then(|reply| self.quota_checked(check, reply, AnsweredBy::Module));
                    return Ok(TakenWithQuota { client, key, quota });
                }
                // The module is gone from this server: nothing ran; the script takes.
                Err(failure) => self.module_failed(failure)?,
            }
        }
        let (client, key) = match (client, key) {
            (Some(client), Some(key)) => {
                let pair = self.take_pair_remote(client, key, id).await?;
                (Some(pair.client), pair.key)
            }
            (Some(client), None) => (Some(self.take_remote(client, id).await?), None),
            (None, Some(key)) => (None, Some(self.take_remote(key, id).await?)),
            (None, None) => (None, None),
        };
        // Its own round trip: what it meets is the check's, the buckets' answers stand.
        let quota = self.quota_check_remote(check).await;
        Ok(TakenWithQuota { client, key, quota })
    }

    /// A pair across slots in two calls: the client bucket, then, if it allowed, the
    /// key bucket; a key bucket that refuses gets the client bucket's tokens back (only
    /// what Redis took: never a local or forwarded decision's).
    async fn take_pair_in_two_calls(
        &self,
        client: &Bucket,
        key: &Bucket,
        cost: u64,
    ) -> Result<PairDecision, Error> {
        let client_decision = self.take(client, cost).await?;
        if !client_decision.allowed {
            return Ok(PairDecision {
                client: client_decision,
                key: None,
            });
        }
        let key_decision = self.take(key, cost).await?;
        let from_redis = matches!(
            client_decision.answered_by,
            AnsweredBy::Module | AnsweredBy::Script
        );
        if !key_decision.allowed && from_redis {
            if let Err(error) = self.refund(client, cost).await {
                // Counted in the errors: the token stays spent.
                log::warn!(target: "qag_client", "giving back {}'s token failed: {error}", client.key());
            }
        }
        Ok(PairDecision {
            client: client_decision,
            key: Some(key_decision),
        })
    }

    /// What `take` would answer now, writing nothing.
    pub async fn peek(&self, bucket: &Bucket, cost: u64) -> Result<Decision, Error> {
        let this = &self.for_keys(&[bucket.key()]).await?;
        let call = BucketCall::new(bucket, cost)?;
        this.run(this.peek_remote(&call), |instead| {
            Some(match instead {
                Instead::Forward => call.forwarded(),
                Instead::Local {
                    state,
                    now_micros,
                    share,
                } => call.local_decision(state.buckets.peek(
                    &call.key,
                    call.local_limit(share),
                    call.args.cost,
                    seconds(now_micros),
                )),
            })
        })
        .await
    }

    /// Gives `n` tokens back to `bucket`: QAG.REFUND, or `lua/token_refund.lua` without
    /// the module. For a request that one limit admitted and a later one refused. Only
    /// with the caller's id is it sent once more after a dropped connection: twice
    /// without one would give back twice.
    pub async fn refund(&self, bucket: &Bucket, n: u64) -> Result<Refunded, Error> {
        let this = &self.for_keys(&[bucket.key()]).await?;
        let call = BucketCall::new(bucket, 1)?;
        let (key, count) = (bucket.key(), bucket.count());
        let n_text = n.to_string();
        let count_text = count.to_string();
        let words = ["QAG.REFUND", key, &count_text, &call.period_text, &n_text];
        let args = check(|words| bucket::parse_refund(words), &words)?;
        let id = this.request_id();
        let remote = async {
            let remaining = if this.path().await? == Path::Module {
                let mut command = cmd("QAG.REFUND");
                command.arg(key).arg(count).arg(&call.period_text).arg(n);
                push_id(&mut command, id);
                let refunded = match id {
                    Some(_) => this.query_replayable::<i64>(&command).await,
                    None => this.query::<i64>(&command).await,
                };
                match refunded {
                    Ok(left) => Some((left, AnsweredBy::Module)),
                    Err(failure) => {
                        this.module_failed(failure)?;
                        None
                    }
                }
            } else {
                None
            };
            let (left, answered_by) = match remaining {
                Some(answer) => answer,
                None => {
                    let script = match id {
                        Some(_) => &this.shared.refund_script_with_ids,
                        None => &this.shared.refund_script,
                    };
                    let mut invocation = script.key(key);
                    invocation.arg(count).arg(&call.period_text).arg(n);
                    push_script_id(&mut invocation, id);
                    let invocation = &invocation;
                    // Resent after a dropped connection only with an id: twice without one
                    // would give back twice.
                    let left: i64 = this
                        .sent(
                            |mut con| async move { invocation.invoke_async(&mut con).await },
                            id.is_some(),
                        )
                        .await
                        .map_err(failure_error)?;
                    (left, AnsweredBy::Script)
                }
            };
            let remaining = u64::try_from(left)
                .map_err(|_| Error::Server(format!("a QAG.REFUND reply, got {left}").into()))?;
            this.saw(&call, remaining);
            Ok(Refunded {
                remaining,
                answered_by,
            })
        };
        this.run(remote, |instead| {
            Some(match instead {
                Instead::Forward => Refunded {
                    remaining: count,
                    answered_by: AnsweredBy::Forwarded,
                },
                Instead::Local {
                    state,
                    now_micros,
                    share,
                } => Refunded {
                    remaining: state
                        .buckets
                        .refund(
                            key,
                            call.local_limit(share),
                            args.amount,
                            seconds(now_micros),
                        )
                        .max(0) as u64,
                    answered_by: AnsweredBy::Local,
                },
            })
        })
        .await
    }

    async fn take_remote(&self, call: &BucketCall, id: Option<&str>) -> Result<Decision, Error> {
        if self.path().await? == Path::Module {
            let mut command = call.take_command(id);
            self.wait_words(&mut command);
            let command = &command;
            let sent = self.sent_waiting(
                |mut con| async move { command.query_async::<Vec<i64>>(&mut con).await },
                true,
            );
            match sent.await {
                Ok(reply) => return self.decided(call, &reply, AnsweredBy::Module),
                Err(failure) => self.module_failed(failure)?,
            }
        }
        self.take_by_script(call, id).await
    }

    async fn take_pair_remote(
        &self,
        client: &BucketCall,
        key: &BucketCall,
        id: Option<&str>,
    ) -> Result<PairDecision, Error> {
        if self.path().await? == Path::Module {
            let mut command = pair_command(client, key, id);
            self.wait_words(&mut command);
            let command = &command;
            let sent = self.sent_waiting(
                |mut con| async move {
                    command
                        .query_async::<(Vec<i64>, Option<Vec<i64>>)>(&mut con)
                        .await
                },
                true,
            );
            match sent.await {
                Ok(reply) => return self.pair_decided(client, key, reply, AnsweredBy::Module),
                Err(failure) => self.module_failed(failure)?,
            }
        }
        // TAKE2's twin: both buckets in one call, atomic as TAKE2 is (the keys are on
        // one server, or in one cluster slot: see `take_pair`).
        let mut invocation = self.bucket_script(id).key(&client.key);
        invocation
            .key(&key.key)
            .arg(client.count)
            .arg(&client.period_text)
            .arg(key.count)
            .arg(&key.period_text)
            .arg(client.cost);
        push_script_id(&mut invocation, id);
        let reply = self
            .replayed(|mut con| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut con).await }
            })
            .await
            .map_err(failure_error)?;
        self.pair_decided(client, key, reply, AnsweredBy::Script)
    }

    async fn peek_remote(&self, call: &BucketCall) -> Result<Decision, Error> {
        if self.path().await? == Path::Module {
            match self
                .query_replayable::<Vec<i64>>(&call.command("QAG.PEEK"))
                .await
            {
                Ok(reply) => return self.decided(call, &reply, AnsweredBy::Module),
                Err(failure) => self.module_failed(failure)?,
            }
        }
        // Without the module: the hash and the server's clock, read in one round trip,
        // computed with the module's arithmetic.
        let mut pipe = redis::pipe();
        pipe.cmd("TIME")
            .cmd("HMGET")
            .arg(&call.key)
            .arg("tokens")
            .arg("ts");
        type Fields = (Option<Vec<u8>>, Option<Vec<u8>>);
        let pipe = &pipe;
        let ((seconds, micros), fields): ((i64, i64), Fields) = self
            .replayed(|mut con| async move { pipe.query_async(&mut con).await })
            .await
            .map_err(failure_error)?;
        let state = bucket::parse_state(fields.0.as_deref(), fields.1.as_deref());
        let now = bucket::seconds_from_micros(seconds.saturating_mul(1_000_000) + micros);
        let verdict = bucket::take(call.args.limit, call.args.cost, state, now).verdict;
        self.decided(call, &verdict.as_reply(), AnsweredBy::Script)
    }

    /// The script's take, sent once more after a dropped connection: with the caller's
    /// id a replay, answered as the first call was; without one an admission, stricter
    /// by one if the first ran, as the module's without an id.
    async fn take_by_script(&self, call: &BucketCall, id: Option<&str>) -> Result<Decision, Error> {
        let mut invocation = self.bucket_script(id).key(&call.key);
        invocation
            .arg(call.count)
            .arg(&call.period_text)
            .arg(call.cost);
        push_script_id(&mut invocation, id);
        let reply: Vec<i64> = self
            .replayed(|mut con| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut con).await }
            })
            .await
            .map_err(failure_error)?;
        self.decided(call, &reply, AnsweredBy::Script)
    }

    /// The token-bucket script: with a request id, the one that remembers it.
    fn bucket_script(&self, id: Option<&str>) -> &redis::Script {
        match id {
            Some(_) => &self.shared.script_with_ids,
            None => &self.shared.script,
        }
    }

    /// QAG.TAKE2's reply (or its script's) as both decisions (the key's None when it
    /// was not counted).
    fn pair_decided(
        &self,
        client: &BucketCall,
        key: &BucketCall,
        (client_reply, key_reply): (Vec<i64>, Option<Vec<i64>>),
        by: AnsweredBy,
    ) -> Result<PairDecision, Error> {
        let key_decision = key_reply
            .map(|reply| self.decided(key, &reply, by))
            .transpose()?;
        Ok(PairDecision {
            client: self.decided(client, &client_reply, by)?,
            key: key_decision,
        })
    }

    /// A bucket's decision from Redis's reply, noted as Redis's last word on it, where
    /// local counting would begin.
    fn decided(&self, call: &BucketCall, reply: &[i64], by: AnsweredBy) -> Result<Decision, Error> {
        let decision = call.decision(reply, by)?;
        self.saw(call, decision.remaining);
        Ok(decision)
    }

    fn saw(&self, call: &BucketCall, left: u64) {
        let now = seconds(unix_micros());
        lock(&self.node.local)
            .buckets
            .saw(&call.key, call.args.limit, left, now);
    }
}
