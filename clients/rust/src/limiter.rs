//! The thin layer that talks to Redis: which backend answers, the per-call deadline,
//! the back-off of the `Local` policy, and the commands themselves.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use qag_core::args::ArgError;
use qag_core::bucket::{self, Limit, TakeArgs};
use redis::aio::ConnectionLike;
use redis::{cmd, Cmd, FromRedisValue, Value};

use crate::decision::{
    Admission, AnsweredBy, Decision, LeaseRefusal, PairDecision, Per, Quota, QuotaDecision,
    QuotaUsage, Scope,
};
use crate::error::{classify, Error, Failure};
use crate::lease::{Lease, LeaseGuard};
use crate::local::LocalBuckets;

/// The repository's token-bucket script, compiled in: the module's contract, one text.
pub const TOKEN_BUCKET_LUA: &str = include_str!("../../../lua/token_bucket.lua");

/// Where token-bucket calls go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    /// The module where the server has it, else the script; asked with
    /// `COMMAND INFO qag.take` and remembered.
    #[default]
    Auto,
    /// The module only: [`Error::ModuleRequired`] where it is missing.
    Module,
    /// The script only, even where the module is loaded.
    Script,
}

/// What a token-bucket call does when Redis is unreachable or too slow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnUnavailable {
    /// Return the error ([`Error::Unavailable`] or [`Error::Timeout`]): the caller
    /// forwards, fails open or fails closed.
    #[default]
    Error,
    /// Decide in this process's memory for `back_off` without touching Redis, each
    /// bucket starting full, then try Redis again.
    Local { back_off: Duration },
}

impl OnUnavailable {
    /// The gateway's documented rule: 5 s of local counting after a failure.
    pub const LOCAL: OnUnavailable = OnUnavailable::Local {
        back_off: Duration::from_secs(5),
    };
}

/// How a [`Limiter`] behaves; `Options::default()` is what a gateway runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    pub backend: Backend,
    /// Every call's deadline, detection and fallback included.
    pub deadline: Duration,
    pub on_unavailable: OnUnavailable,
    /// How long a server found without the module is believed: after that, `Auto`
    /// asks again (the module may have been loaded in a rolling upgrade).
    pub recheck_missing_module: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            backend: Backend::Auto,
            deadline: Duration::from_millis(500),
            on_unavailable: OnUnavailable::Error,
            recheck_missing_module: Duration::from_secs(10),
        }
    }
}

/// What `Auto` knows of the server.
#[derive(Clone, Copy, Debug)]
enum Presence {
    Unknown,
    Present,
    Missing { since: Instant },
}

/// The path a call takes to Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Module,
    Script,
}

struct Shared {
    presence: Mutex<Presence>,
    back_off: Mutex<BackOff>,
    local_decisions: AtomicU64,
    script: redis::Script,
}

#[derive(Default)]
struct BackOff {
    /// Set while buckets are counted locally; the back-off ends at this instant.
    until: Option<Instant>,
    buckets: LocalBuckets,
}

/// A rate limiter over one connection (a `ConnectionManager`, a `MultiplexedConnection`
/// or an async cluster connection). Cheap to clone: clones share what they know of the
/// server and the local buckets.
pub struct Limiter<C> {
    con: C,
    options: Options,
    shared: Arc<Shared>,
}

impl<C: Clone> Clone for Limiter<C> {
    fn clone(&self) -> Self {
        Limiter {
            con: self.con.clone(),
            options: self.options,
            shared: self.shared.clone(),
        }
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
    fn new(key: &str, count: u64, period: f64, cost: u64) -> Result<BucketCall, Error> {
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
        let args = check(|words| bucket::parse_take(words), &words)?;
        Ok(BucketCall {
            key: key.to_owned(),
            args,
            count,
            period,
            period_text,
            cost,
        })
    }

    fn limit(&self) -> Limit {
        self.args.limit
    }

    fn decision(&self, reply: &[i64], answered_by: AnsweredBy) -> Result<Decision, Error> {
        Decision::from_reply(reply, self.count, self.period, answered_by).map_err(Error::Server)
    }

    fn local_decision(&self, verdict: bucket::Verdict) -> Decision {
        Decision {
            allowed: verdict.allowed,
            limit: self.count,
            period: self.period,
            remaining: verdict.tokens_left.max(0) as u64,
            retry_after: verdict.retry_after,
            answered_by: AnsweredBy::Local,
        }
    }
}

/// A number as the module and the script read it back: the shortest exact decimal.
fn number_text(value: f64) -> String {
    if value.is_finite() {
        qag_core::number::format_number(&mut ryu::Buffer::new(), value).to_owned()
    } else {
        // Refused by the parser with the module's message.
        value.to_string()
    }
}

fn invalid(error: ArgError) -> Error {
    let text = error.to_string();
    Error::InvalidArgument(text.strip_prefix("ERR ").unwrap_or(&text).to_owned())
}

fn unix_now() -> f64 {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros() as i64);
    bucket::seconds_from_micros(micros)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded values stay consistent at every await-free step: a panic elsewhere
    // leaves nothing half-written.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<C> Limiter<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    pub fn new(con: C) -> Limiter<C> {
        Limiter::with_options(con, Options::default())
    }

    pub fn with_options(con: C, options: Options) -> Limiter<C> {
        Limiter {
            con,
            options,
            shared: Arc::new(Shared {
                presence: Mutex::new(Presence::Unknown),
                back_off: Mutex::new(BackOff::default()),
                local_decisions: AtomicU64::new(0),
                script: redis::Script::new(TOKEN_BUCKET_LUA),
            }),
        }
    }

    pub fn options(&self) -> Options {
        self.options
    }

    /// True while token buckets are decided in this process (a back-off is running).
    pub fn counting_locally(&self) -> bool {
        lock(&self.shared.back_off)
            .until
            .is_some_and(|until| Instant::now() < until)
    }

    /// How many bucket decisions were made locally since the limiter was built.
    pub fn local_decisions(&self) -> u64 {
        self.shared.local_decisions.load(Ordering::Relaxed)
    }

    /// Takes `cost` tokens from the bucket at `key` (`count` per `period` seconds).
    pub async fn take(
        &self,
        key: &str,
        count: u64,
        period: f64,
        cost: u64,
    ) -> Result<Decision, Error> {
        let call = BucketCall::new(key, count, period, cost)?;
        self.bucket_decision(
            |buckets, now| take_locally(buckets, &call, now),
            || self.take_remote(&call),
        )
        .await
    }

    /// Both buckets of a request: the client's, then, only if it allowed, the key's;
    /// `cost` from each. QAG.TAKE2 where the module is, else the script on the client
    /// bucket and, if it allowed, on the key bucket (two round trips).
    #[allow(clippy::too_many_arguments)]
    pub async fn take_pair(
        &self,
        client_key: &str,
        client_count: u64,
        client_period: f64,
        key_key: &str,
        key_count: u64,
        key_period: f64,
        cost: u64,
    ) -> Result<PairDecision, Error> {
        let client = BucketCall::new(client_key, client_count, client_period, cost)?;
        let key = BucketCall::new(key_key, key_count, key_period, cost)?;
        self.bucket_decision(
            |buckets, now| {
                let client = take_locally(buckets, &client, now);
                let key = client.allowed.then(|| take_locally(buckets, &key, now));
                PairDecision { client, key }
            },
            || self.take_pair_remote(&client, &key),
        )
        .await
    }

    /// What `take` would answer now, writing nothing.
    pub async fn peek(
        &self,
        key: &str,
        count: u64,
        period: f64,
        cost: u64,
    ) -> Result<Decision, Error> {
        let call = BucketCall::new(key, count, period, cost)?;
        self.bucket_decision(
            |buckets, now| {
                call.local_decision(buckets.peek(&call.key, call.limit(), call.args.cost, now))
            },
            || self.peek_remote(&call),
        )
        .await
    }

    /// Takes a concurrency slot of `key` (at most `max` at once) for `id`, held for
    /// `ttl` and renewed every `ttl / 3` by the returned guard until it is released or
    /// dropped. Module only.
    pub async fn lease(
        &self,
        key: &str,
        max: u64,
        ttl: Duration,
        id: &str,
    ) -> Result<Lease<C>, Error> {
        let ttl_ms = ttl.as_millis().to_string();
        let max = max.to_string();
        check(
            |words| qag_core::lease::parse_lease(words),
            &["QAG.LEASE", key, &max, &ttl_ms, id],
        )?;
        let reply: Vec<i64> = self
            .module_call(cmd("QAG.LEASE").arg(key).arg(&max).arg(&ttl_ms).arg(id))
            .await?;
        match *reply {
            [1, _, _] => Ok(Lease::Held(LeaseGuard::start(
                self.clone(),
                key.to_owned(),
                id.to_owned(),
                ttl,
            ))),
            [0, live, retry] => Ok(Lease::Refused(LeaseRefusal {
                live: live.max(0) as u64,
                retry_after: retry.max(0) as u64,
            })),
            _ => Err(Error::Server(format!("a QAG.LEASE reply, got {reply:?}"))),
        }
    }

    /// Extends `id`'s lease to now + `ttl`; false when the lease is gone.
    pub async fn renew(&self, key: &str, id: &str, ttl: Duration) -> Result<bool, Error> {
        let ttl_ms = ttl.as_millis().to_string();
        check(
            |words| qag_core::lease::parse_renew(words),
            &["QAG.RENEW", key, id, &ttl_ms],
        )?;
        let renewed: i64 = self
            .module_call(cmd("QAG.RENEW").arg(key).arg(id).arg(&ttl_ms))
            .await?;
        Ok(renewed == 1)
    }

    /// Frees `id`'s slot; false when it held none.
    pub async fn release(&self, key: &str, id: &str) -> Result<bool, Error> {
        check(
            |words| qag_core::lease::parse_release(words),
            &["QAG.RELEASE", key, id],
        )?;
        let released: i64 = self
            .module_call(cmd("QAG.RELEASE").arg(key).arg(id))
            .await?;
        Ok(released == 1)
    }

    /// The live leases of `key`.
    pub async fn leases(&self, key: &str) -> Result<u64, Error> {
        check(
            |words| qag_core::lease::parse_leases(words),
            &["QAG.LEASES", key],
        )?;
        let live: i64 = self.module_call(cmd("QAG.LEASES").arg(key)).await?;
        Ok(live.max(0) as u64)
    }

    /// The check before a call: whether `quota` allows one more. Module only.
    pub async fn quota_check(&self, key: &str, quota: &Quota) -> Result<QuotaDecision, Error> {
        let mut words = vec!["QAG.QUOTA".to_owned(), key.to_owned()];
        words.extend(quota_words(quota.per, &quota.zone));
        let limits = [("CALLS", quota.calls), ("ROWS", quota.rows)];
        for (name, limit) in limits {
            if let Some(limit) = limit {
                words.extend([name.to_owned(), limit.to_string()]);
            }
        }
        check(|words| qag_core::quota::parse_quota(words), &words)?;
        let reply: Vec<Option<i64>> = self.module_call(&command(&words)).await?;
        QuotaDecision::from_reply(&reply, quota).map_err(Error::Server)
    }

    /// The count after a call: adds `calls` and `rows` to the current period.
    pub async fn quota_add(
        &self,
        key: &str,
        per: Per,
        zone: &str,
        calls: u64,
        rows: u64,
    ) -> Result<QuotaUsage, Error> {
        self.quota_count("QAG.QUOTA.ADD", key, per, zone, calls, rows)
            .await
    }

    /// Seeds the current period from the gateway's durable store (each count becomes
    /// the larger of Redis's and the seed).
    pub async fn quota_seed(
        &self,
        key: &str,
        per: Per,
        zone: &str,
        calls: u64,
        rows: u64,
    ) -> Result<QuotaUsage, Error> {
        self.quota_count("QAG.QUOTA.SEED", key, per, zone, calls, rows)
            .await
    }

    async fn quota_count(
        &self,
        command_name: &str,
        key: &str,
        per: Per,
        zone: &str,
        calls: u64,
        rows: u64,
    ) -> Result<QuotaUsage, Error> {
        let mut words = vec![command_name.to_owned(), key.to_owned()];
        words.extend(quota_words(per, zone));
        words.extend([
            "CALLS".into(),
            calls.to_string(),
            "ROWS".into(),
            rows.to_string(),
        ]);
        check(|words| qag_core::quota::parse_quota(words), &words)?;
        let reply: Vec<i64> = self.module_call(&command(&words)).await?;
        QuotaUsage::from_reply(&reply).map_err(Error::Server)
    }

    /// Admits a request through every scope of a chain (requests and tokens per
    /// window, default 60 s), charging one request to each when admitted. Module only.
    pub async fn admit(&self, scopes: &[Scope], window: Option<u32>) -> Result<Admission, Error> {
        let mut words = vec!["QAG.ADMIT".to_owned(), scopes.len().to_string()];
        for scope in scopes {
            words.extend([
                scope.key.clone(),
                scope.rpm.to_string(),
                scope.tpm.to_string(),
            ]);
        }
        push_window(&mut words, window);
        check(|words| qag_core::window::parse_admit(words), &words)?;
        let reply: Vec<i64> = self.module_call(&command(&words)).await?;
        Admission::from_reply(&reply).map_err(Error::Server)
    }

    /// Charges `tokens` to every scope's current window after the response; answers
    /// the number of scopes charged.
    pub async fn record(
        &self,
        keys: &[&str],
        tokens: u64,
        window: Option<u32>,
    ) -> Result<u64, Error> {
        let mut words = vec!["QAG.RECORD".to_owned(), keys.len().to_string()];
        words.extend(keys.iter().map(|key| key.to_string()));
        words.push(tokens.to_string());
        push_window(&mut words, window);
        check(|words| qag_core::window::parse_record(words), &words)?;
        let charged: i64 = self.module_call(&command(&words)).await?;
        Ok(charged.max(0) as u64)
    }

    /// Runs a bucket decision: locally during a back-off, else on Redis; a failure to
    /// reach Redis starts a back-off under the `Local` policy and is decided locally.
    async fn bucket_decision<T, L, R, F>(&self, locally: L, remote: R) -> Result<T, Error>
    where
        L: FnOnce(&mut LocalBuckets, f64) -> T,
        R: FnOnce() -> F,
        F: std::future::Future<Output = Result<T, Error>>,
    {
        let OnUnavailable::Local { back_off } = self.options.on_unavailable else {
            return self.within_deadline(remote()).await;
        };
        let backing_off = lock(&self.shared.back_off)
            .until
            .is_some_and(|until| Instant::now() < until);
        if backing_off {
            return Ok(self.decide_locally(locally));
        }
        match self.within_deadline(remote()).await {
            Err(error) if error.is_unavailable() => {
                lock(&self.shared.back_off).until = Some(Instant::now() + back_off);
                Ok(self.decide_locally(locally))
            }
            answer => {
                if answer.is_ok() {
                    let mut state = lock(&self.shared.back_off);
                    if state.until.take().is_some() {
                        // Redis answers again: the next outage starts every bucket full.
                        state.buckets.clear();
                    }
                }
                answer
            }
        }
    }

    fn decide_locally<T>(&self, locally: impl FnOnce(&mut LocalBuckets, f64) -> T) -> T {
        self.shared.local_decisions.fetch_add(1, Ordering::Relaxed);
        locally(&mut lock(&self.shared.back_off).buckets, unix_now())
    }

    /// Bounds a call by the deadline; a server that failed to answer is asked again
    /// whether it has the module (it may have been restarted without it, or with it).
    async fn within_deadline<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let answer = tokio::time::timeout(self.options.deadline, call)
            .await
            .unwrap_or(Err(Error::Timeout));
        if answer.as_ref().is_err_and(Error::is_unavailable) {
            *lock(&self.shared.presence) = Presence::Unknown;
        }
        answer
    }

    async fn take_remote(&self, call: &BucketCall) -> Result<Decision, Error> {
        if self.path().await? == Path::Module {
            let command = bucket_command("QAG.TAKE", call);
            match self.query::<Vec<i64>>(&command).await {
                Ok(reply) => return call.decision(&reply, AnsweredBy::Module),
                Err(failure) => self.module_failed(failure)?,
            }
        }
        self.take_by_script(call).await
    }

    async fn take_pair_remote(
        &self,
        client: &BucketCall,
        key: &BucketCall,
    ) -> Result<PairDecision, Error> {
        if self.path().await? == Path::Module {
            let mut command = cmd("QAG.TAKE2");
            command
                .arg(&client.key)
                .arg(client.count)
                .arg(&client.period_text)
                .arg(&key.key)
                .arg(key.count)
                .arg(&key.period_text);
            push_cost(&mut command, client.cost);
            match self.query::<(Vec<i64>, Option<Vec<i64>>)>(&command).await {
                Ok((client_reply, key_reply)) => {
                    let key_decision = key_reply
                        .map(|reply| key.decision(&reply, AnsweredBy::Module))
                        .transpose()?;
                    return Ok(PairDecision {
                        client: client.decision(&client_reply, AnsweredBy::Module)?,
                        key: key_decision,
                    });
                }
                Err(failure) => self.module_failed(failure)?,
            }
        }
        let client_decision = self.take_by_script(client).await?;
        let key_decision = if client_decision.allowed {
            Some(self.take_by_script(key).await?)
        } else {
            None
        };
        Ok(PairDecision {
            client: client_decision,
            key: key_decision,
        })
    }

    async fn peek_remote(&self, call: &BucketCall) -> Result<Decision, Error> {
        if self.path().await? == Path::Module {
            let command = bucket_command("QAG.PEEK", call);
            match self.query::<Vec<i64>>(&command).await {
                Ok(reply) => return call.decision(&reply, AnsweredBy::Module),
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
        let ((seconds, micros), fields): ((i64, i64), Fields) = pipe
            .query_async(&mut self.con.clone())
            .await
            .map_err(|error| failure_error(classify(&error)))?;
        let state = bucket::parse_state(fields.0.as_deref(), fields.1.as_deref());
        let now = bucket::seconds_from_micros(seconds.saturating_mul(1_000_000) + micros);
        let verdict = bucket::take(call.limit(), call.args.cost, state, now).verdict;
        call.decision(&verdict.as_reply(), AnsweredBy::Script)
    }

    async fn take_by_script(&self, call: &BucketCall) -> Result<Decision, Error> {
        let reply: Vec<i64> = self
            .shared
            .script
            .key(&call.key)
            .arg(call.count)
            .arg(&call.period_text)
            .arg(call.cost)
            .invoke_async(&mut self.con.clone())
            .await
            .map_err(|error| failure_error(classify(&error)))?;
        call.decision(&reply, AnsweredBy::Script)
    }

    /// A module command failed: a missing command means the module is gone from this
    /// server; `Auto` goes on with the script, `Module` reports it.
    fn module_failed(&self, failure: Failure) -> Result<(), Error> {
        match failure {
            Failure::UnknownCommand => {
                self.note_missing();
                if self.options.backend == Backend::Auto {
                    Ok(())
                } else {
                    Err(Error::ModuleRequired)
                }
            }
            Failure::Error(error) => Err(error),
        }
    }

    /// A command of a family without a script: ModuleRequired where the module is
    /// known missing or turns out missing.
    async fn module_call<T: FromRedisValue>(&self, command: &Cmd) -> Result<T, Error> {
        self.within_deadline(async {
            if self.options.backend == Backend::Script || self.path().await? == Path::Script {
                return Err(Error::ModuleRequired);
            }
            self.query(command).await.map_err(|failure| match failure {
                Failure::UnknownCommand => {
                    self.note_missing();
                    Error::ModuleRequired
                }
                Failure::Error(error) => error,
            })
        })
        .await
    }

    /// Which path a bucket call takes now.
    async fn path(&self) -> Result<Path, Error> {
        match self.options.backend {
            Backend::Module => return Ok(Path::Module),
            Backend::Script => return Ok(Path::Script),
            Backend::Auto => {}
        }
        let presence = *lock(&self.shared.presence);
        match presence {
            Presence::Present => return Ok(Path::Module),
            Presence::Missing { since }
                if since.elapsed() < self.options.recheck_missing_module =>
            {
                return Ok(Path::Script)
            }
            _ => {}
        }
        let command = cmd("COMMAND").arg("INFO").arg("qag.take").to_owned();
        let found = match self.query::<Value>(&command).await {
            Ok(Value::Array(entries)) => !matches!(entries.as_slice(), [] | [Value::Nil]),
            Ok(other) => {
                return Err(Error::Server(format!(
                    "a COMMAND INFO reply, got {other:?}"
                )))
            }
            // A user without COMMAND: try the module's command; its answer tells.
            Err(Failure::Error(Error::Permission(_))) => true,
            Err(failure) => return Err(failure_error(failure)),
        };
        if found {
            *lock(&self.shared.presence) = Presence::Present;
            Ok(Path::Module)
        } else {
            self.note_missing();
            Ok(Path::Script)
        }
    }

    fn note_missing(&self) {
        *lock(&self.shared.presence) = Presence::Missing {
            since: Instant::now(),
        };
    }

    async fn query<T: FromRedisValue>(&self, command: &Cmd) -> Result<T, Failure> {
        command
            .query_async(&mut self.con.clone())
            .await
            .map_err(|error| classify(&error))
    }
}

fn take_locally(buckets: &mut LocalBuckets, call: &BucketCall, now: f64) -> Decision {
    call.local_decision(buckets.take(&call.key, call.limit(), call.args.cost, now))
}

fn bucket_command(name: &str, call: &BucketCall) -> Cmd {
    let mut command = cmd(name);
    command
        .arg(&call.key)
        .arg(call.count)
        .arg(&call.period_text);
    push_cost(&mut command, call.cost);
    command
}

/// `COST n`, left out for the default 1 (less for the server to read).
fn push_cost(command: &mut Cmd, cost: u64) {
    if cost != 1 {
        command.arg("COST").arg(cost);
    }
}

/// An unknown command where none was expected is an error like any other.
fn failure_error(failure: Failure) -> Error {
    match failure {
        Failure::UnknownCommand => Error::ModuleRequired,
        Failure::Error(error) => error,
    }
}

fn quota_words(per: Per, zone: &str) -> [String; 4] {
    ["PER".into(), per.as_str().into(), "TZ".into(), zone.into()]
}

fn push_window(words: &mut Vec<String>, window: Option<u32>) {
    if let Some(window) = window {
        words.extend(["WINDOW".into(), window.to_string()]);
    }
}

fn command(words: &[String]) -> Cmd {
    let (name, args) = words.split_first().expect("a command has a name");
    let mut command = cmd(name);
    command.arg(args);
    command
}

/// Checks a command's words with the module's own parser before anything is sent.
fn check<T, S: AsRef<str>>(
    parse: impl FnOnce(&[&[u8]]) -> Result<T, ArgError>,
    words: &[S],
) -> Result<T, Error> {
    let bytes: Vec<&[u8]> = words.iter().map(|word| word.as_ref().as_bytes()).collect();
    parse(&bytes).map_err(invalid)
}
