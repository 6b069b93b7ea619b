//! Token reservations: QAG.ADMIT … RESERVE tokens ID id holds an estimate of a request's
//! tokens on every scope of its chain, QAG.RECORD … ID id PARTIAL pays part of it early,
//! QAG.RECORD … ID id commits the actual count and releases the hold. A hold is never
//! left to expire by a call that failed to close it: a guard dropped without `commit`
//! commits what was charged in the background, and a reserve that timed out or was
//! cancelled after sending releases its id the same way: its ADMIT replayed, then a
//! commit of 0 (a commit that ran before its ADMIT would be a plain record, and the
//! ADMIT's hold would then count until it expires; after the replay, whichever ADMIT
//! ran first made the one hold, and the other is a replay).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use qag_core::window;
use redis::aio::ConnectionLike;

use crate::decision::{Admission, AnsweredBy, Recorded, Scope};
use crate::error::Error;
use crate::limiter::{unix_micros, Limiter};
use crate::mutex::lock;
use crate::windows::{as_tokens, clock, Reserve};

/// A reservation's admission and the hold it keeps until [`Reservation::commit`]. A
/// refused request holds nothing; one admitted by the `Forward` policy holds nothing
/// either (its `charge` and `commit` count nothing and say so: `AnsweredBy::Forwarded`);
/// one admitted by the `Local` policy is counted in this process, its charges recorded
/// as plain records. Dropped without `commit` (an error, a cancelled request), it
/// commits what `charge` paid so far in the background, so the hold is released at once
/// instead of counting until it expires.
pub struct Reservation<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    limiter: Limiter<C>,
    keys: Vec<String>,
    window: Option<u32>,
    id: String,
    admission: Admission,
    reserved: u64,
    /// What `charge` sent so far (the commit of a drop: what the partials paid).
    charged: u64,
    /// When the hold stops counting at the latest: background commits stop trying then.
    until: Instant,
    /// Holds tokens in Redis until committed.
    open: bool,
    /// Tokens held in this process's window (a reservation the `Local` policy admitted).
    held_locally: u64,
}

impl<C> std::fmt::Debug for Reservation<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("keys", &self.keys)
            .field("id", &self.id)
            .field("admission", &self.admission)
            .field("reserved", &self.reserved)
            .field("charged", &self.charged)
            .field("open", &self.open)
            .finish_non_exhaustive()
    }
}

/// How long a hold counts at most: until the end of the next window, or `hold` when that
/// is sooner (the module's rule, without its rounding to a sixteenth of the window).
fn hold_bound(window: Option<u32>, hold: Option<Duration>) -> Duration {
    let seconds = window.map_or(window::DEFAULT_WINDOW_SECONDS as u64, u64::from);
    let windows = Duration::from_secs(seconds * 2);
    hold.map_or(windows, |hold| hold.min(windows))
}

impl<C> Reservation<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    pub fn admission(&self) -> Admission {
        self.admission
    }

    pub fn admitted(&self) -> bool {
        self.admission.admitted
    }

    /// The request id the reservation is held under (the caller's, or one made for it).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The tokens reserved (0 for a refused request).
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// What [`Reservation::charge`] paid so far.
    pub fn charged(&self) -> u64 {
        self.charged
    }

    /// `Module` or `Script` for a hold in Redis (or a refusal Redis answered), `Local` or
    /// `Forwarded` for an admission the outage policy answered.
    pub fn answered_by(&self) -> AnsweredBy {
        self.admission.answered_by
    }

    /// Pays `tokens` of the request's count now (a stream charged as it goes): QAG.RECORD
    /// … ID id PARTIAL, the hold shrinking by as much. Never resent: the commit settles a
    /// partial whose reply was lost. A refused request charges nothing (`charged: 0`).
    pub async fn charge(&mut self, tokens: u64) -> Result<Recorded, Error> {
        if !self.admission.admitted {
            return Ok(self.nothing());
        }
        let keys: Vec<&str> = self.keys.iter().map(String::as_str).collect();
        match self.admission.answered_by {
            AnsweredBy::Module | AnsweredBy::Script => {
                // Counted before it is sent: a drop commits it whether it ran or not.
                self.charged = self.charged.saturating_add(tokens);
                self.limiter
                    .record_as(&keys, tokens, self.window, &self.id, true, false)
                    .await
            }
            AnsweredBy::Local => {
                let paid = tokens.min(self.held_locally);
                self.release_locally(paid);
                self.held_locally -= paid;
                self.charged = self.charged.saturating_add(tokens);
                self.limiter.record(&keys, tokens, self.window).await
            }
            AnsweredBy::Forwarded => Ok(self.nothing()),
        }
    }

    /// Commits the request's whole count, `actual` (the partials included: the module
    /// charges what they did not pay) and releases the hold: QAG.RECORD … ID id,
    /// replayable. A commit that did not reach Redis (an outage, a back-off) is
    /// returned as it was answered and goes on in the background, so the hold is
    /// released as soon as Redis answers.
    pub async fn commit(mut self, actual: u64) -> Result<Recorded, Error> {
        if !self.admission.admitted {
            return Ok(self.nothing());
        }
        let keys: Vec<&str> = self.keys.iter().map(String::as_str).collect();
        match self.admission.answered_by {
            AnsweredBy::Module | AnsweredBy::Script => {
                self.open = false;
                let answer = self
                    .limiter
                    .record_as(&keys, actual, self.window, &self.id, false, false)
                    .await;
                if !matches!(
                    answer,
                    Ok(Recorded {
                        answered_by: AnsweredBy::Module | AnsweredBy::Script,
                        ..
                    })
                ) {
                    commit_in_background(
                        &self.limiter,
                        &self.keys,
                        self.window,
                        &self.id,
                        actual,
                        self.until,
                    );
                }
                answer
            }
            AnsweredBy::Local => {
                self.release_locally(self.held_locally);
                self.held_locally = 0;
                let rest = actual.saturating_sub(self.charged);
                self.limiter.record(&keys, rest, self.window).await
            }
            AnsweredBy::Forwarded => Ok(self.nothing()),
        }
    }

    /// Stops holding `tokens` of a hold in this process's window.
    fn release_locally(&self, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let keys: Vec<&str> = self.keys.iter().map(String::as_str).collect();
        let clock = clock(self.window, unix_micros());
        lock(&self.limiter.node.local)
            .windows
            .release(&keys, as_tokens(tokens), &clock);
    }

    fn nothing(&self) -> Recorded {
        Recorded {
            charged: 0,
            answered_by: self.admission.answered_by,
        }
    }
}

impl<C> Drop for Reservation<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn drop(&mut self) {
        self.release_locally(self.held_locally);
        if self.open {
            commit_in_background(
                &self.limiter,
                &self.keys,
                self.window,
                &self.id,
                self.charged,
                self.until,
            );
        }
    }
}

/// Commits `id`'s reservation with `tokens` without anyone waiting: straight to Redis,
/// whatever the back-off (nobody waits on it, and each attempt is a replay of the one
/// before if that ran), each attempt bounded by the deadline, then again at growing
/// intervals until one answers or the hold has stopped counting by itself at `until`.
/// Outside a tokio runtime the hold is left to expire (logged).
fn commit_in_background<C>(
    limiter: &Limiter<C>,
    keys: &[String],
    window: Option<u32>,
    id: &str,
    tokens: u64,
    until: Instant,
) where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let commit = Commit {
        keys: keys.to_vec(),
        window,
        tokens,
    };
    settle_in_background(limiter, id, None, commit, until);
}

/// A commit to send: QAG.RECORD … ID id of `tokens` on the reservation's chain.
struct Commit {
    keys: Vec<String>,
    window: Option<u32>,
    tokens: u64,
}

/// Sends `commit` (after `admit`, a replay of the reservation's ADMIT: its scopes and
/// tokens, if given) until Redis answers, as [`commit_in_background`] says. The replay
/// holds for what is left until `until` at most: on a server that lost the first ADMIT
/// (a restart, a failover before it replicated) it makes a hold of its own, which must
/// not outlive the one it stands for if the commit after it never gets through.
fn settle_in_background<C>(
    limiter: &Limiter<C>,
    id: &str,
    admit: Option<(Vec<Scope>, u64)>,
    commit: Commit,
    until: Instant,
) where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        log::warn!(target: "qag_client", "reservation {id} dropped outside a tokio runtime: its hold counts until it expires");
        return;
    };
    let (limiter, id) = (limiter.clone(), id.to_owned());
    runtime.spawn(async move {
        let mut wait = Duration::from_millis(100);
        let keys: Vec<&str> = commit.keys.iter().map(String::as_str).collect();
        loop {
            let attempt = tokio::time::timeout(limiter.shared.deadline, async {
                if let Some((scopes, tokens)) = &admit {
                    let left = until.saturating_duration_since(Instant::now());
                    let reserve = Reserve {
                        tokens: *tokens,
                        hold: Some(left),
                    };
                    limiter
                        .admit_remote(scopes, commit.window, Some(reserve), Some(&id))
                        .await?;
                }
                limiter
                    .record_remote(&keys, commit.tokens, commit.window, &id, false, false)
                    .await
            })
            .await;
            let error = match attempt {
                Ok(Ok(_)) => return,
                Ok(Err(error)) if error.is_unavailable() => error,
                Ok(Err(error)) => {
                    // An error reply (NOPERM, WRONGTYPE): no attempt will do better.
                    limiter.background_failure("committing a reservation", &error);
                    return;
                }
                Err(_) => Error::Timeout,
            };
            if Instant::now() + wait >= until {
                limiter.background_failure("committing a reservation", &error);
                return;
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(1));
        }
    });
}

/// Releases the hold of a reserve that returned no guard holding it (timed out, its
/// future dropped, answered by the policy after the ADMIT may have run).
struct PendingReserve<'a, C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    limiter: &'a Limiter<C>,
    keys: &'a [String],
    window: Option<u32>,
    id: &'a str,
    /// The ADMIT's scopes and tokens, replayed before the release.
    scopes: &'a [Scope],
    tokens: u64,
    until: Instant,
    sent: &'a AtomicBool,
}

impl<C> Drop for PendingReserve<'_, C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn drop(&mut self) {
        if self.sent.load(Ordering::Acquire) {
            let release = Commit {
                keys: self.keys.to_vec(),
                window: self.window,
                tokens: 0,
            };
            let admit = Some((self.scopes.to_vec(), self.tokens));
            settle_in_background(self.limiter, self.id, admit, release, self.until);
        }
    }
}

impl<C> Limiter<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Admits a request through every scope of a chain, as [`Limiter::admit`], and
    /// holds `tokens` (the estimate: input plus `max_tokens`) on every scope with a tpm
    /// until the returned guard commits the actual count: QAG.ADMIT … RESERVE tokens ID
    /// id [HOLD ms]. Admitted only if the tokens fit beside what is counted and held.
    /// `hold` shortens how long the hold may count (default: until the end of the next
    /// window). Replayable. If the call fails or is cancelled after the ADMIT may have
    /// run, its hold is released in the background.
    pub async fn reserve(
        &self,
        scopes: &[Scope],
        tokens: u64,
        window: Option<u32>,
        hold: Option<Duration>,
    ) -> Result<Reservation<C>, Error> {
        let id = self.call_id();
        let keys: Vec<String> = scopes.iter().map(|scope| scope.key.clone()).collect();
        let until = Instant::now() + hold_bound(window, hold);
        // The keys' node (its local window holds what the `Local` policy reserves), and
        // the whole deadline for each later call, not what the reserve leaves.
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut limiter = self.for_keys(&key_refs).await?;
        limiter.options.deadline = limiter.shared.deadline;
        let sent = AtomicBool::new(false);
        let reserve = Reserve { tokens, hold };
        let pending = PendingReserve {
            limiter: &limiter,
            keys: &keys,
            window,
            id: &id,
            scopes,
            tokens,
            until,
            sent: &sent,
        };
        let admission = limiter
            .admit_as(scopes, window, Some(reserve), Some(&id), Some(&sent))
            .await;
        let admission = match admission {
            Ok(admission) => admission,
            Err(error) => {
                drop(pending);
                return Err(error);
            }
        };
        // Redis answered: its answer says what is held (a refusal holds nothing).
        let in_redis = matches!(
            admission.answered_by,
            AnsweredBy::Module | AnsweredBy::Script
        );
        let open = in_redis && admission.admitted;
        if in_redis {
            sent.store(false, Ordering::Release);
        }
        drop(pending);
        Ok(Reservation {
            limiter,
            keys,
            window,
            id,
            admission,
            reserved: if admission.admitted { tokens } else { 0 },
            charged: 0,
            until,
            open,
            held_locally: match admission.answered_by {
                AnsweredBy::Local if admission.admitted => tokens,
                _ => 0,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_counts_until_the_next_window_ends_or_sooner() {
        let minute = Duration::from_secs(60);
        assert_eq!(hold_bound(None, None), minute * 2);
        assert_eq!(hold_bound(Some(4), None), Duration::from_secs(8));
        assert_eq!(
            hold_bound(None, Some(Duration::from_secs(5))),
            Duration::from_secs(5)
        );
        assert_eq!(hold_bound(Some(1), Some(minute)), Duration::from_secs(2));
    }
}
