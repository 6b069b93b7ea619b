//! A held concurrency slot that renews itself while the work runs.

use std::time::Duration;

use redis::aio::ConnectionLike;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::decision::LeaseRefusal;
use crate::error::Error;
use crate::limiter::Limiter;

/// What [`Limiter::lease`] answers: the slot, or the refusal when every slot is held.
pub enum Lease<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    Held(LeaseGuard<C>),
    Refused(LeaseRefusal),
}

/// A held lease. A background task renews it every third of its TTL; `release()`
/// frees the slot, and dropping the guard without releasing stops the renewals and
/// releases it in the background (or, outside a tokio runtime, lets it run out).
pub struct LeaseGuard<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    limiter: Limiter<C>,
    key: String,
    id: String,
    renewals: JoinHandle<()>,
    lost: watch::Receiver<bool>,
    released: bool,
}

impl<C> LeaseGuard<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    pub(crate) fn start(limiter: Limiter<C>, key: String, id: String, ttl: Duration) -> Self {
        let (report_lost, lost) = watch::channel(false);
        let renewals = tokio::spawn(renew_until_lost(
            limiter.clone(),
            key.clone(),
            id.clone(),
            ttl,
            report_lost,
        ));
        LeaseGuard {
            limiter,
            key,
            id,
            renewals,
            lost,
            released: false,
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// True once a renewal found the lease gone (it ran out, or was removed): the slot
    /// is no longer held; stop the work or acquire again.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Waits until a renewal finds the lease gone (for a `select!` beside the work).
    pub async fn lost(&mut self) {
        // An error means the renewals ended without finding it lost: wait forever.
        if self.lost.wait_for(|lost| *lost).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Stops renewing and frees the slot; true when the lease was still held.
    pub async fn release(mut self) -> Result<bool, Error> {
        self.released = true;
        self.renewals.abort();
        self.limiter.release(&self.key, &self.id).await
    }
}

impl<C> Drop for LeaseGuard<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn drop(&mut self) {
        self.renewals.abort();
        if self.released {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (limiter, key, id) = (self.limiter.clone(), self.key.clone(), self.id.clone());
            runtime.spawn(async move {
                // Best effort: if it fails, the lease runs out by its TTL.
                let _ = limiter.release(&key, &id).await;
            });
        }
    }
}

async fn renew_until_lost<C>(
    limiter: Limiter<C>,
    key: String,
    id: String,
    ttl: Duration,
    report_lost: watch::Sender<bool>,
) where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let every = (ttl / 3).max(Duration::from_millis(1));
    loop {
        tokio::time::sleep(every).await;
        match limiter.renew(&key, &id, ttl).await {
            Ok(true) => {}
            Ok(false) => {
                let _ = report_lost.send(true);
                return;
            }
            // Redis failed this time: two more renewals fit in the TTL.
            Err(_) => {}
        }
    }
}
