//! Concurrency slots: QAG.LEASE, QAG.RENEW, QAG.RELEASE and QAG.LEASES where the module
//! is, `lua/lease.lua` where it is not, a guard that renews a held slot and gives it back,
//! and the answers of the outage policy. A slot is never stranded by a call that failed to return it: an acquire that
//! timed out or was dropped after the LEASE may have run releases its id in the
//! background, and so does a guard dropped without `release()`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;
use redis::{cmd, Cmd};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::decision::{AnsweredBy, LeaseRefusal, RetryAfter};
use crate::error::Error;
use crate::limiter::unix_micros;
use crate::limiter::{check, Answer, Instead, Limiter};
use crate::local::share_of;
use crate::mutex::lock;

/// What [`Limiter::lease`] answers: the slot, or the refusal when every slot is held.
/// (One is made a request and matched at once: the guard is not boxed.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Lease<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    Held(LeaseGuard<C>),
    Refused(LeaseRefusal),
}

impl<C> Answer for Lease<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn answered_by(&self) -> Option<AnsweredBy> {
        Some(match self {
            Lease::Held(guard) => guard.answered_by,
            Lease::Refused(refusal) => refusal.answered_by,
        })
    }
}

/// What the renewals found, for [`LeaseGuard::is_lost`] and [`LeaseGuard::last_error`].
#[derive(Default)]
struct Renewals {
    last_error: Mutex<Option<Error>>,
}

/// A held lease. For a lease held in Redis a background task renews it every third of
/// its TTL; `release()` frees the slot, and dropping the guard without releasing stops
/// the renewals and releases it in the background (or, outside a tokio runtime, lets
/// it run out). A lease taken by the `Local` policy is counted in this process; one
/// taken by the `Forward` policy holds nothing.
pub struct LeaseGuard<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    limiter: Limiter<C>,
    key: String,
    id: String,
    ttl: Duration,
    answered_by: AnsweredBy,
    renewals: Option<JoinHandle<()>>,
    renewed: Arc<Renewals>,
    lost: watch::Receiver<bool>,
    released: bool,
    /// The key's live leases when this one was taken, this one included.
    live: u64,
    /// How long the server held the LEASE for a slot (`Limiter::with_wait`).
    waited: Duration,
}

impl<C> std::fmt::Debug for LeaseGuard<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("key", &self.key)
            .field("id", &self.id)
            .field("answered_by", &self.answered_by)
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

impl<C> LeaseGuard<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn new(
        limiter: &Limiter<C>,
        key: &str,
        id: &str,
        ttl: Duration,
        answered_by: AnsweredBy,
    ) -> Self {
        // Renewals and releases get the whole deadline each, not what the acquire left,
        // and never wait.
        let mut limiter = limiter.clone();
        limiter.options.deadline = limiter.shared.deadline;
        limiter.wait = None;
        let (report_lost, lost) = watch::channel(false);
        let renewed = Arc::new(Renewals::default());
        let in_redis = matches!(answered_by, AnsweredBy::Module | AnsweredBy::Script);
        let renewals = in_redis.then(|| {
            tokio::spawn(renew_until_lost(
                limiter.clone(),
                key.to_owned(),
                id.to_owned(),
                ttl,
                renewed.clone(),
                report_lost,
            ))
        });
        LeaseGuard {
            limiter,
            key: key.to_owned(),
            id: id.to_owned(),
            ttl,
            answered_by,
            renewals,
            renewed,
            lost,
            released: false,
            live: 0,
            waited: Duration::ZERO,
        }
    }

    fn taken_among(mut self, live: u64, waited: Duration) -> Self {
        self.live = live;
        self.waited = waited;
        self
    }

    /// How long the server held the LEASE before it was given a slot (zero for one
    /// given at once; see [`Limiter::with_wait`]).
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// The key's live leases when this one was taken, this one included (0 for a slot
    /// the `Forward` policy answered: nothing was counted).
    pub fn live(&self) -> u64 {
        self.live
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// `Module` or `Script` for a slot held in Redis, `Local` or `Forwarded` for one the
    /// outage policy answered.
    pub fn answered_by(&self) -> AnsweredBy {
        self.answered_by
    }

    /// True once the lease can no longer be confirmed: a renewal found it gone, or none
    /// succeeded within its TTL (it may have run out). Stop the work or acquire again.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// The last renewal error, if any renewal failed.
    pub fn last_error(&self) -> Option<Error> {
        lock(&self.renewed.last_error).clone()
    }

    /// Waits until the lease is lost (for a `select!` beside the work).
    pub async fn lost(&mut self) {
        // An error means the renewals ended without finding it lost: wait forever.
        if self.lost.wait_for(|lost| *lost).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Stops renewing and frees the slot; true when the lease was still held. An error
    /// is returned, and the release goes on in the background as a drop's would;
    /// dropping the guard instead releases in the background and never fails.
    pub async fn release(mut self) -> Result<bool, Error> {
        self.released = true;
        self.stop_renewing();
        match self.answered_by {
            AnsweredBy::Module | AnsweredBy::Script => {
                let answer = self.limiter.release(&self.key, &self.id).await;
                if answer.is_err() {
                    // Not given back now (a back-off, an outage): in the background, as
                    // a drop would, so the slot does not wait for its TTL.
                    let until = Instant::now() + self.ttl;
                    release_in_background(&self.limiter, &self.key, &self.id, until);
                }
                answer
            }
            AnsweredBy::Local => {
                lock(&self.limiter.node.local)
                    .leases
                    .release(&self.key, &self.id);
                Ok(true)
            }
            AnsweredBy::Forwarded => Ok(true),
        }
    }

    fn stop_renewing(&mut self) {
        if let Some(renewals) = self.renewals.take() {
            renewals.abort();
        }
    }
}

impl<C> Drop for LeaseGuard<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn drop(&mut self) {
        self.stop_renewing();
        if self.released {
            return;
        }
        match self.answered_by {
            AnsweredBy::Module | AnsweredBy::Script => release_in_background(
                &self.limiter,
                &self.key,
                &self.id,
                Instant::now() + self.ttl,
            ),
            AnsweredBy::Local => lock(&self.limiter.node.local)
                .leases
                .release(&self.key, &self.id),
            AnsweredBy::Forwarded => {}
        }
    }
}

/// Frees `id`'s slot without anyone waiting: tried at once, then again at growing
/// intervals (a release that answers 0 may have overtaken its LEASE, which a stalled
/// server still runs) until one answers 1 or the lease has run out by itself at `until`.
fn release_in_background<C>(limiter: &Limiter<C>, key: &str, id: &str, until: Instant)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (limiter, key, id) = (limiter.clone(), key.to_owned(), id.to_owned());
    runtime.spawn(async move {
        let mut wait = Duration::from_millis(100);
        let mut last_error = None;
        loop {
            let attempt =
                tokio::time::timeout(limiter.shared.deadline, limiter.release_remote(&key, &id))
                    .await;
            match attempt {
                Ok(Ok(true)) => return,
                Ok(Ok(false)) => {}
                Ok(Err(error)) => last_error = Some(error),
                Err(_) => last_error = Some(Error::Timeout),
            }
            if Instant::now() + wait >= until {
                if let Some(error) = last_error {
                    limiter.background_failure("releasing a lease", &error);
                }
                return;
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(1));
        }
    });
}

/// Releases the slot of an acquire that did not return a guard, if the LEASE was sent
/// and no reply said it took nothing.
struct PendingAcquire<'a, C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    limiter: &'a Limiter<C>,
    key: &'a str,
    id: &'a str,
    until: Instant,
    maybe_held: &'a AtomicBool,
}

impl<C> Drop for PendingAcquire<'_, C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn drop(&mut self) {
        if self.maybe_held.load(Ordering::Acquire) {
            release_in_background(self.limiter, self.key, self.id, self.until);
        }
    }
}

async fn renew_until_lost<C>(
    limiter: Limiter<C>,
    key: String,
    id: String,
    ttl: Duration,
    renewed: Arc<Renewals>,
    report_lost: watch::Sender<bool>,
) where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let every = (ttl / 3).max(Duration::from_millis(1));
    let mut confirmed = Instant::now();
    let ttl_ms = ttl.as_millis().to_string();
    loop {
        tokio::time::sleep(every).await;
        // Straight to Redis, whatever the back-off: nobody waits on a renewal, and one
        // that gets through during a back-off keeps a slot a blip would have lost.
        let answer = tokio::time::timeout(
            limiter.options.deadline,
            limiter.renew_remote(&key, &id, &ttl_ms),
        )
        .await
        .unwrap_or(Err(Error::Timeout));
        match answer {
            Ok(Renewed(true)) => confirmed = Instant::now(),
            Ok(Renewed(false)) => break,
            Err(error) => {
                log::warn!(target: "qag_client", "renewing lease {id} of {key} failed: {error}");
                *lock(&renewed.last_error) = Some(error);
                // The next renewal would come after the lease ran out.
                if confirmed.elapsed() + every >= ttl {
                    break;
                }
            }
        }
    }
    let _ = report_lost.send(true);
}

impl<C> Limiter<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Takes a concurrency slot of `key` (at most `max` at once) for `id`, held for
    /// `ttl` and renewed every `ttl / 3` by the returned guard until it is released or
    /// dropped. If the call fails or is cancelled after the LEASE may have run, `id` is
    /// released in the background.
    pub async fn lease(
        &self,
        key: &str,
        max: u64,
        ttl: Duration,
        id: &str,
    ) -> Result<Lease<C>, Error> {
        let this = &self.for_keys(&[key]).await?;
        let ttl_ms = ttl.as_millis().to_string();
        let max_text = max.to_string();
        check(
            |words| qag_core::lease::parse_lease(words),
            &["QAG.LEASE", key, &max_text, &ttl_ms, id],
        )?;
        let maybe_held = AtomicBool::new(false);
        let pending = PendingAcquire {
            limiter: this,
            key,
            id,
            until: Instant::now() + ttl,
            maybe_held: &maybe_held,
        };
        let remote = async {
            maybe_held.store(true, Ordering::Release);
            let command = cmd("QAG.LEASE")
                .arg(key)
                .arg(&max_text)
                .arg(&ttl_ms)
                .arg(id)
                .to_owned();
            let mut script = this.shared.lease_script.key(key);
            script.arg("acquire").arg(&max_text).arg(&ttl_ms).arg(id);
            let (reply, answered_by) = match this
                .family_call_waiting::<Vec<i64>>(&command, &script, false)
                .await
            {
                Ok(answer) => answer,
                Err(error) => {
                    // An error reply ran nothing; a lost connection may have.
                    if !error.is_unavailable() {
                        maybe_held.store(false, Ordering::Release);
                    }
                    return Err(error);
                }
            };
            maybe_held.store(false, Ordering::Release);
            let (reply, waited) = match reply[..] {
                [acquired, live, retry, waited] => ([acquired, live, retry], waited),
                [acquired, live, retry] => ([acquired, live, retry], 0),
                _ => {
                    return Err(Error::Server(
                        format!("a QAG.LEASE reply, got {reply:?}").into(),
                    ))
                }
            };
            let waited = Duration::from_millis(waited.max(0) as u64);
            let [_, live, _] = reply;
            let now = unix_micros() as f64 / 1e6;
            let ttl_ms = ttl.as_millis().min(u128::from(u64::MAX)) as u64;
            lock(&this.node.local)
                .leases
                .saw(key, live.max(0) as u64, ttl_ms, now);
            match reply {
                [1, live, _] => Ok(Lease::Held(
                    LeaseGuard::new(this, key, id, ttl, answered_by)
                        .taken_among(live.max(0) as u64, waited),
                )),
                [0, live, retry] => Ok(Lease::Refused(LeaseRefusal {
                    live: live.max(0) as u64,
                    retry_after: RetryAfter::Seconds(retry.max(0) as u64),
                    answered_by,
                    waited,
                })),
                _ => Err(Error::Server(
                    format!("a QAG.LEASE reply, got {reply:?}").into(),
                )),
            }
        };
        let answer = this
            .run(remote, |instead| {
                Some(match instead {
                    Instead::Forward => {
                        Lease::Held(LeaseGuard::new(this, key, id, ttl, AnsweredBy::Forwarded))
                    }
                    Instead::Local {
                        state,
                        share,
                        now_micros,
                    } => {
                        let now = now_micros as f64 / 1e6;
                        match state
                            .leases
                            .acquire(key, id, share_of(max, share), share, now)
                        {
                            Ok(()) => {
                                let live = state.leases.live(key, share, now);
                                Lease::Held(
                                    LeaseGuard::new(this, key, id, ttl, AnsweredBy::Local)
                                        .taken_among(live, Duration::ZERO),
                                )
                            }
                            Err(live) => Lease::Refused(LeaseRefusal {
                                live,
                                retry_after: RetryAfter::Seconds(1),
                                answered_by: AnsweredBy::Local,
                                waited: Duration::ZERO,
                            }),
                        }
                    }
                })
            })
            .await;
        drop(pending);
        answer
    }

    /// Extends `id`'s lease to now + `ttl`; false when the lease is gone.
    pub async fn renew(&self, key: &str, id: &str, ttl: Duration) -> Result<bool, Error> {
        let this = &self.for_keys(&[key]).await?;
        let ttl_ms = ttl.as_millis().to_string();
        check(
            |words| qag_core::lease::parse_renew(words),
            &["QAG.RENEW", key, id, &ttl_ms],
        )?;
        this.run(this.renew_remote(key, id, &ttl_ms), |_| None)
            .await
            .map(|renewed| renewed.0)
    }

    /// Frees `id`'s slot; false when it held none.
    pub async fn release(&self, key: &str, id: &str) -> Result<bool, Error> {
        let this = &self.for_keys(&[key]).await?;
        check(
            |words| qag_core::lease::parse_release(words),
            &["QAG.RELEASE", key, id],
        )?;
        this.run(this.release_remote(key, id), |_| None).await
    }

    /// The live leases of `key` (under the `Local` policy, during a back-off: the ones
    /// this process counts).
    pub async fn leases(&self, key: &str) -> Result<u64, Error> {
        let this = &self.for_keys(&[key]).await?;
        check(
            |words| qag_core::lease::parse_leases(words),
            &["QAG.LEASES", key],
        )?;
        let remote = async {
            let mut script = this.shared.lease_script.key(key);
            script.arg("count");
            let command = cmd("QAG.LEASES").arg(key).to_owned();
            let (live, _) = this.family_call::<i64>(&command, &script, true).await?;
            Ok(live.max(0) as u64)
        };
        this.run(remote, |instead| match instead {
            Instead::Forward => None,
            Instead::Local {
                state,
                share,
                now_micros,
            } => Some(state.leases.live(key, share, now_micros as f64 / 1e6)),
        })
        .await
    }

    /// QAG.RENEW, or the script's renew: whether the lease is still held.
    async fn renew_remote(&self, key: &str, id: &str, ttl_ms: &str) -> Result<Renewed, Error> {
        let command = cmd("QAG.RENEW").arg(key).arg(id).arg(ttl_ms).to_owned();
        let mut script = self.shared.lease_script.key(key);
        script.arg("renew").arg(id).arg(ttl_ms);
        let (held, _) = self.family_call::<i64>(&command, &script, false).await?;
        Ok(Renewed(held == 1))
    }

    /// QAG.RELEASE, or the script's release: whether a live lease was released.
    async fn release_remote(&self, key: &str, id: &str) -> Result<bool, Error> {
        let command: Cmd = cmd("QAG.RELEASE").arg(key).arg(id).to_owned();
        let mut script = self.shared.lease_script.key(key);
        script.arg("release").arg(id);
        let (released, _) = self.family_call::<i64>(&command, &script, false).await?;
        Ok(released == 1)
    }
}

/// A renewal's answer: whether the lease is still held.
struct Renewed(bool);

impl Answer for Renewed {
    fn answered_by(&self) -> Option<AnsweredBy> {
        None
    }
}
