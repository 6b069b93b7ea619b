//! The thin layer that talks to Redis: the connection, which backend answers, the
//! per-call deadline, and running every call under the outage policy. The commands of
//! each family are in their own files (buckets, leases, quotas, windows).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use qag_core::args::ArgError;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{cmd, Cmd, FromRedisValue, Value};

use crate::decision::AnsweredBy;
use crate::error::{classify, Error, Failure};
use crate::local::LocalState;
use crate::policy::{Counts, OnUnavailable, Outage, Route};

/// The repository's token-bucket script, compiled in: the module's contract, one text.
pub const TOKEN_BUCKET_LUA: &str = include_str!("../../../lua/token_bucket.lua");
/// The repository's refund script, QAG.REFUND's twin on the same keys.
pub const TOKEN_REFUND_LUA: &str = include_str!("../../../lua/token_refund.lua");

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

/// How a [`Limiter`] behaves; `Options::default()` is what a gateway runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Options {
    pub backend: Backend,
    /// Every call's deadline: connecting, detection and fallback included.
    pub deadline: Duration,
    /// What a call does when Redis fails, and during the back-off after it.
    pub on_unavailable: OnUnavailable,
    /// How long Redis is left alone after a failure (zero: every call tries Redis; a
    /// day at most). When it ends, one call probes Redis; the others keep to the policy
    /// until the probe has answered.
    pub back_off: Duration,
    /// This process's share of every limit under [`OnUnavailable::Local`]: 1/N for N
    /// gateway processes keeps a fleet near its limits during an outage. Above 1 counts
    /// as 1; zero, negative or NaN as 1 too.
    pub local_share: f64,
    /// How long a server found without the module is believed: after that, `Auto`
    /// asks again (the module may have been loaded in a rolling upgrade).
    pub recheck_missing_module: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            backend: Backend::Auto,
            deadline: Duration::from_millis(500),
            on_unavailable: OnUnavailable::Raise,
            back_off: Duration::from_secs(5),
            local_share: 1.0,
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
pub(crate) enum Path {
    Module,
    Script,
}

pub(crate) struct Shared {
    presence: Mutex<Presence>,
    outage: Mutex<Outage>,
    pub(crate) local: Mutex<LocalState>,
    counts: Mutex<Counts>,
    /// Something was counted locally since Redis last answered (without a back-off,
    /// the next answer drops it).
    counted_locally: AtomicBool,
    pub(crate) script: redis::Script,
    pub(crate) refund_script: redis::Script,
}

/// A rate limiter over one connection (a `ConnectionManager`, a `MultiplexedConnection`
/// or an async cluster connection). Cheap to clone: clones share what they know of the
/// server, the back-off and the local counts.
pub struct Limiter<C> {
    pub(crate) con: C,
    pub(crate) options: Options,
    pub(crate) shared: Arc<Shared>,
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

impl<C> std::fmt::Debug for Limiter<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("options", &self.options)
            .field("counts", &*lock(&self.shared.counts))
            .finish_non_exhaustive()
    }
}

/// What a call answers, and how it was made (for [`Limiter::counts`]).
pub(crate) trait Answer {
    fn answered_by(&self) -> Option<AnsweredBy>;
}

impl Answer for bool {
    fn answered_by(&self) -> Option<AnsweredBy> {
        None
    }
}

impl Answer for u64 {
    fn answered_by(&self) -> Option<AnsweredBy> {
        None
    }
}

/// What answers a call that does not reach Redis, under the `Forward` and `Local`
/// policies; the family's closure answers None where it has nothing to answer (then the
/// outage's error is returned).
pub(crate) enum Instead<'a> {
    Forward,
    Local {
        state: &'a mut LocalState,
        /// Unix microseconds.
        now_micros: i64,
        share: f64,
    },
}

pub(crate) fn unix_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros() as i64)
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded values stay consistent at every await-free step: a panic elsewhere
    // leaves nothing half-written.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The probe's turn, given back if the probe's future is dropped before Redis answered.
struct ProbeTurn<'a> {
    outage: &'a Mutex<Outage>,
    probe: bool,
}

impl Drop for ProbeTurn<'_> {
    fn drop(&mut self) {
        if self.probe {
            lock(self.outage).probe_abandoned();
        }
    }
}

impl Limiter<ConnectionManager> {
    /// A limiter on its own `ConnectionManager` for `url` that connects on first use, so
    /// a gateway starts while Redis is down. Connecting and reconnecting are bounded by
    /// the deadline, like every call. Call it inside a tokio runtime.
    pub async fn connect(url: &str, options: Options) -> Result<Limiter<ConnectionManager>, Error> {
        let client = redis::Client::open(url)
            .map_err(|error| Error::InvalidArgument(format!("redis URL {url:?}: {error}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.deadline))
            .set_response_timeout(Some(options.deadline))
            // One reconnect attempt per failure: the limiter's back-off paces the rest.
            .set_number_of_retries(1);
        let con = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|error| failure_error(classify(&error)))?;
        Ok(Limiter::with_options(con, options))
    }
}

impl<C> Limiter<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    pub fn new(con: C) -> Limiter<C> {
        Limiter::with_options(con, Options::default())
    }

    pub fn with_options(con: C, mut options: Options) -> Limiter<C> {
        let share = options.local_share;
        options.local_share = if share > 0.0 { share.min(1.0) } else { 1.0 };
        Limiter {
            con,
            options,
            shared: Arc::new(Shared {
                presence: Mutex::new(Presence::Unknown),
                outage: Mutex::new(Outage::default()),
                local: Mutex::new(LocalState::default()),
                counts: Mutex::new(Counts::default()),
                counted_locally: AtomicBool::new(false),
                script: redis::Script::new(TOKEN_BUCKET_LUA),
                refund_script: redis::Script::new(TOKEN_REFUND_LUA),
            }),
        }
    }

    pub fn options(&self) -> Options {
        self.options
    }

    /// True while Redis is left alone after a failure (a back-off runs or its probe is
    /// out): calls are answered by the policy.
    pub fn backing_off(&self) -> bool {
        lock(&self.shared.outage).backing_off(Instant::now())
    }

    /// True while calls are decided in this process (`Local`, backing off).
    pub fn counting_locally(&self) -> bool {
        self.options.on_unavailable == OnUnavailable::Local && self.backing_off()
    }

    /// How many calls were decided locally since the limiter was built.
    pub fn local_decisions(&self) -> u64 {
        lock(&self.shared.counts).local
    }

    /// How calls were answered since the limiter was built, and how many failed.
    pub fn counts(&self) -> Counts {
        *lock(&self.shared.counts)
    }

    /// A failure nobody awaits (a background release or renewal): counted and logged.
    pub(crate) fn background_failure(&self, what: &str, error: &Error) {
        lock(&self.shared.counts).errors += 1;
        log::warn!(target: "qag_client", "{what} failed: {error}");
    }

    /// Runs one call under the outage policy: to Redis within the deadline unless a
    /// back-off runs; an outage starts a back-off and is answered by the policy.
    pub(crate) async fn run<T: Answer>(
        &self,
        remote: impl std::future::Future<Output = Result<T, Error>>,
        instead: impl FnOnce(Instead<'_>) -> Option<T>,
    ) -> Result<T, Error> {
        let route = lock(&self.shared.outage).route(Instant::now());
        let answer = match route {
            Route::Policy => {
                let cause = lock(&self.shared.outage).backing_off_error();
                self.answer_instead(instead, cause)
            }
            Route::Redis { probe } => {
                let mut turn = ProbeTurn {
                    outage: &self.shared.outage,
                    probe,
                };
                let answer = self.within_deadline(remote).await;
                turn.probe = false;
                match answer {
                    Err(error) if error.is_unavailable() => {
                        lock(&self.shared.outage).failed(
                            probe,
                            Instant::now(),
                            self.options.back_off,
                            &error,
                        );
                        self.answer_instead(instead, error)
                    }
                    answer => {
                        let ended = lock(&self.shared.outage).answered(probe);
                        let no_back_off = self.options.back_off.is_zero()
                            && self.shared.counted_locally.swap(false, Ordering::Relaxed);
                        if ended || no_back_off {
                            lock(&self.shared.local).clear();
                        }
                        answer
                    }
                }
            }
        };
        let mut counts = lock(&self.shared.counts);
        match &answer {
            Ok(answer) => {
                if let Some(by) = answer.answered_by() {
                    counts.count(by);
                }
            }
            Err(_) => counts.errors += 1,
        }
        answer
    }

    fn answer_instead<T>(
        &self,
        instead: impl FnOnce(Instead<'_>) -> Option<T>,
        cause: Error,
    ) -> Result<T, Error> {
        let answer = match self.options.on_unavailable {
            OnUnavailable::Raise => None,
            OnUnavailable::Forward => instead(Instead::Forward),
            OnUnavailable::Local => {
                self.shared.counted_locally.store(true, Ordering::Relaxed);
                instead(Instead::Local {
                    state: &mut lock(&self.shared.local),
                    now_micros: unix_micros(),
                    share: self.options.local_share,
                })
            }
        };
        answer.ok_or(cause)
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

    /// A module command failed: a missing command means the module is gone from this
    /// server; `Auto` goes on with the script, `Module` reports it.
    pub(crate) fn module_failed(&self, failure: Failure) -> Result<(), Error> {
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
    pub(crate) async fn module_call<T: FromRedisValue>(&self, command: &Cmd) -> Result<T, Error> {
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
    }

    /// Which path a bucket call takes now.
    pub(crate) async fn path(&self) -> Result<Path, Error> {
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
                return Err(Error::Server(
                    format!("a COMMAND INFO reply, got {other:?}").into(),
                ))
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

    pub(crate) async fn query<T: FromRedisValue>(&self, command: &Cmd) -> Result<T, Failure> {
        command
            .query_async(&mut self.con.clone())
            .await
            .map_err(|error| classify(&error))
    }
}

/// An unknown command where none was expected is an error like any other.
pub(crate) fn failure_error(failure: Failure) -> Error {
    match failure {
        Failure::UnknownCommand => Error::ModuleRequired,
        Failure::Error(error) => error,
    }
}

pub(crate) fn command(words: &[String]) -> Cmd {
    let mut command = Cmd::new();
    for word in words {
        command.arg(word);
    }
    command
}

fn invalid(error: ArgError) -> Error {
    let text = error.to_string();
    Error::InvalidArgument(text.strip_prefix("ERR ").unwrap_or(&text).to_owned())
}

/// Checks a command's words with the module's own parser before anything is sent.
pub(crate) fn check<T, S: AsRef<str>>(
    parse: impl FnOnce(&[&[u8]]) -> Result<T, ArgError>,
    words: &[S],
) -> Result<T, Error> {
    let bytes: Vec<&[u8]> = words.iter().map(|word| word.as_ref().as_bytes()).collect();
    parse(&bytes).map_err(invalid)
}
