//! Sliding windows across a chain of scopes: QAG.ADMIT before a model call, QAG.RECORD
//! of its tokens after it (or `lua/window.lua` where the module is not), and the answers
//! of the outage policy. Both carry an id and are replayed after a dropped connection;
//! reservations (`RESERVE`, `PARTIAL`) are built on them in reservations.rs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use qag_core::window::{self, Clock};
use redis::aio::ConnectionLike;

use crate::decision::{Admission, AnsweredBy, Recorded, RetryAfter, Scope};
use crate::error::Error;
use crate::limiter::{check, command, unix_micros, Answer, Instead, Limiter};
use crate::local::share_of;
use crate::mutex::lock;

impl Answer for Admission {
    fn answered_by(&self) -> Option<AnsweredBy> {
        Some(self.answered_by)
    }
}

impl Answer for Recorded {
    fn answered_by(&self) -> Option<AnsweredBy> {
        Some(self.answered_by)
    }
}

fn push_window(words: &mut Vec<String>, window: Option<u32>) {
    if let Some(window) = window {
        words.extend(["WINDOW".into(), window.to_string()]);
    }
}

pub(crate) fn as_tokens(tokens: u64) -> i64 {
    i64::try_from(tokens).unwrap_or(i64::MAX)
}

pub(crate) fn clock(window: Option<u32>, now_micros: i64) -> Clock {
    Clock::new(window_seconds(window), now_micros)
}

/// A limit scaled to this process's share; 0 (no limit) stays 0.
fn local_limit(limit: u64, share: f64) -> i64 {
    if limit == 0 {
        0
    } else {
        i64::try_from(share_of(limit, share)).unwrap_or(i64::MAX)
    }
}

/// What an ADMIT reserves: `RESERVE tokens [HOLD ms]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reserve {
    pub(crate) tokens: u64,
    pub(crate) hold: Option<Duration>,
}

impl<C> Limiter<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Admits a request through every scope of a chain (requests and tokens per
    /// window, default 60 s), charging one request to each when admitted.
    /// Sent once more after a dropped connection: with the caller's id
    /// ([`Limiter::with_id`]) it counts once; without (the default: an admission sends
    /// no id of the limiter's), a first call that ran is charged again, erring stricter
    /// by one request.
    pub async fn admit(&self, scopes: &[Scope], window: Option<u32>) -> Result<Admission, Error> {
        self.admit_as(scopes, window, None, self.request_id(), None)
            .await
    }

    /// QAG.ADMIT with `id`, reserving tokens if `reserve` says so; `sent` is set before
    /// the command may reach Redis (for a reservation's release if the call fails).
    pub(crate) async fn admit_as(
        &self,
        scopes: &[Scope],
        window: Option<u32>,
        reserve: Option<Reserve>,
        id: Option<&str>,
        sent: Option<&AtomicBool>,
    ) -> Result<Admission, Error> {
        let this = &self
            .for_keys(
                &scopes
                    .iter()
                    .map(|scope| scope.key.as_str())
                    .collect::<Vec<_>>(),
            )
            .await?;
        check(
            |words| window::parse_admit(words),
            &admit_words(scopes, window, reserve, id),
        )?;
        let remote = async {
            if let Some(sent) = sent {
                sent.store(true, Ordering::Release);
            }
            let admission = this.admit_remote(scopes, window, reserve, id).await?;
            // Redis's last word on the chain, where local counting would begin.
            let chain: Vec<(&str, u64, u64)> = scopes
                .iter()
                .map(|scope| (scope.key.as_str(), scope.rpm, scope.tpm))
                .collect();
            lock(&this.node.local).windows.saw(
                &chain,
                &clock(window, unix_micros()),
                admission.requests_remaining,
                admission.tokens_remaining,
                this.options.local_share,
            );
            Ok(admission)
        };
        let answer = this
            .run(remote, |instead| {
                Some(match instead {
                    Instead::Forward => Admission {
                        admitted: true,
                        refused_by: None,
                        retry_after: RetryAfter::Seconds(0),
                        requests_remaining: None,
                        tokens_remaining: None,
                        answered_by: AnsweredBy::Forwarded,
                    },
                    Instead::Local {
                        state,
                        now_micros,
                        share,
                    } => {
                        let limits: Vec<(&str, window::Limits)> = scopes
                            .iter()
                            .map(|scope| {
                                let limits = window::Limits {
                                    rpm: local_limit(scope.rpm, share),
                                    tpm: local_limit(scope.tpm, share),
                                };
                                (scope.key.as_str(), limits)
                            })
                            .collect();
                        let reserve = reserve.map_or(0, |reserve| as_tokens(reserve.tokens));
                        let reply = state
                            .windows
                            .admit_reserving(&limits, &clock(window, now_micros), reserve)
                            .as_reply();
                        let admission = Admission::from_reply(&reply).ok()?;
                        Admission {
                            answered_by: AnsweredBy::Local,
                            ..admission
                        }
                    }
                })
            })
            .await;
        if let (Some(sent), Err(error)) = (sent, &answer) {
            // An error reply ran nothing; only a call that may have run needs a release.
            if !error.is_unavailable() {
                sent.store(false, Ordering::Release);
            }
        }
        answer
    }

    /// Charges `tokens` to every scope's current window after the response. Replayable:
    /// sent with an id, once more after a dropped connection.
    pub async fn record(
        &self,
        keys: &[&str],
        tokens: u64,
        window: Option<u32>,
    ) -> Result<Recorded, Error> {
        let own_id = self.request_id().is_none();
        self.record_as(keys, tokens, window, &self.call_id(), false, own_id)
            .await
    }

    /// QAG.RECORD with `id`: a commit of its reservation, if it has one, or with
    /// `partial` a part of its count paid early (never resent: the commit settles a
    /// partial that ran twice or never). `own_id`: the limiter's own id of a plain
    /// record, remembered seconds (KEEP), not ID-SECONDS.
    pub(crate) async fn record_as(
        &self,
        keys: &[&str],
        tokens: u64,
        window: Option<u32>,
        id: &str,
        partial: bool,
        own_id: bool,
    ) -> Result<Recorded, Error> {
        let this = &self.for_keys(keys).await?;
        let mut words = record_words(keys, tokens, window, id);
        if partial {
            words.push("PARTIAL".into());
        }
        check(|words| window::parse_record(words), &words)?;
        let remote = this.record_remote(keys, tokens, window, id, partial, own_id);
        this.run(remote, |instead| {
            Some(match instead {
                Instead::Forward => Recorded {
                    charged: 0,
                    answered_by: AnsweredBy::Forwarded,
                },
                Instead::Local {
                    state, now_micros, ..
                } => {
                    state
                        .windows
                        .record(keys, as_tokens(tokens), &clock(window, now_micros));
                    Recorded {
                        charged: keys.len() as u64,
                        answered_by: AnsweredBy::Local,
                    }
                }
            })
        })
        .await
    }
}

impl<C> Limiter<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// QAG.ADMIT, or the script's admit, straight to Redis (no policy): the admission
    /// and which answered. Sent once more after a dropped connection.
    pub(crate) async fn admit_remote(
        &self,
        scopes: &[Scope],
        window: Option<u32>,
        reserve: Option<Reserve>,
        id: Option<&str>,
    ) -> Result<Admission, Error> {
        let words = admit_words(scopes, window, reserve, id);
        let keys: Vec<&str> = scopes.iter().map(|scope| scope.key.as_str()).collect();
        let mut script = self.shared.window_script.key(&keys[..]);
        script.arg("admit").arg(window_seconds(window));
        for scope in scopes {
            script.arg(scope.rpm).arg(scope.tpm);
        }
        let hold = reserve.and_then(|reserve| reserve.hold).map(hold_millis);
        script
            .arg(reserve.map_or(0, |reserve| reserve.tokens))
            .arg(hold.map_or(String::new(), |ms| ms.to_string()))
            .arg(id.unwrap_or_default())
            .arg("");
        let (reply, answered_by): (Vec<i64>, _) =
            self.family_call(&command(&words), &script, true).await?;
        let admission = Admission::from_reply(&reply).map_err(|why| Error::Server(why.into()))?;
        Ok(Admission {
            answered_by,
            ..admission
        })
    }

    /// QAG.RECORD with `id`, or the script's record, straight to Redis (no policy): the
    /// scopes charged and which answered. A partial charge is never resent; a commit or
    /// a plain record is (it carries its id). `own_id`: the limiter's own id, remembered
    /// seconds (KEEP).
    pub(crate) async fn record_remote(
        &self,
        keys: &[&str],
        tokens: u64,
        window: Option<u32>,
        id: &str,
        partial: bool,
        own_id: bool,
    ) -> Result<Recorded, Error> {
        let mut words = record_words(keys, tokens, window, id);
        if partial {
            words.push("PARTIAL".into());
        }
        let module: Option<i64> = match partial {
            true => self.module_reply(&command(&words), false).await?,
            false => self.spend_call(&words, own_id).await?,
        };
        let (charged, answered_by) = match module {
            Some(charged) => (charged, AnsweredBy::Module),
            None => {
                let keep = (own_id && !partial).then(|| self.own_keep().to_string());
                let mut script = self.shared.window_script.key(keys);
                script
                    .arg("record")
                    .arg(window_seconds(window))
                    .arg(tokens)
                    .arg(id)
                    .arg(keep.unwrap_or_default())
                    .arg(if partial { "1" } else { "" });
                (
                    self.script_reply(&script, !partial).await?,
                    AnsweredBy::Script,
                )
            }
        };
        Ok(Recorded {
            charged: charged.max(0) as u64,
            answered_by,
        })
    }
}

fn window_seconds(window: Option<u32>) -> i64 {
    window.map_or(window::DEFAULT_WINDOW_SECONDS, i64::from)
}

/// A HOLD in whole milliseconds, at least 1 (the module rounds up to a sixteenth of the
/// window).
fn hold_millis(hold: Duration) -> u128 {
    hold.as_millis().max(1)
}

/// QAG.ADMIT's words with `ID id` last (and `RESERVE tokens [HOLD ms]` for a reservation).
pub(crate) fn admit_words(
    scopes: &[Scope],
    window: Option<u32>,
    reserve: Option<Reserve>,
    id: Option<&str>,
) -> Vec<String> {
    let mut words = vec!["QAG.ADMIT".to_owned(), scopes.len().to_string()];
    for scope in scopes {
        words.extend([
            scope.key.clone(),
            scope.rpm.to_string(),
            scope.tpm.to_string(),
        ]);
    }
    push_window(&mut words, window);
    if let Some(reserve) = reserve {
        words.extend(["RESERVE".into(), reserve.tokens.to_string()]);
        if let Some(hold) = reserve.hold {
            words.extend(["HOLD".into(), hold_millis(hold).to_string()]);
        }
    }
    if let Some(id) = id {
        words.extend(["ID".into(), id.to_owned()]);
    }
    words
}

/// QAG.RECORD's words with `ID id` (a commit, or a plain record when `id` holds nothing).
pub(crate) fn record_words<S: AsRef<str>>(
    keys: &[S],
    tokens: u64,
    window: Option<u32>,
    id: &str,
) -> Vec<String> {
    let mut words = vec!["QAG.RECORD".to_owned(), keys.len().to_string()];
    words.extend(keys.iter().map(|key| key.as_ref().to_owned()));
    words.push(tokens.to_string());
    push_window(&mut words, window);
    words.extend(["ID".into(), id.to_owned()]);
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_names_its_id_last_and_the_parser_takes_it() {
        let words = record_words(&["a", "b"], 120, Some(30), "req-1");
        assert_eq!(
            words,
            [
                "QAG.RECORD",
                "2",
                "a",
                "b",
                "120",
                "WINDOW",
                "30",
                "ID",
                "req-1"
            ]
        );
        let args = check(|words| window::parse_record(words), &words).unwrap();
        assert_eq!((args.tokens, args.partial), (120, false));
        let mut partial = record_words(&["a"], 5, None, "req-1");
        partial.push("PARTIAL".into());
        assert!(
            check(|words| window::parse_record(words), &partial)
                .unwrap()
                .partial
        );
    }
}
