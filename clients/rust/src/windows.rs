//! Sliding windows across a chain of scopes: QAG.ADMIT before a model call, QAG.RECORD
//! of its tokens after it (module only), and the answers of the outage policy.

use qag_core::window::{self, Clock};
use redis::aio::ConnectionLike;

use crate::decision::{Admission, AnsweredBy, Recorded, RetryAfter, Scope};
use crate::error::Error;
use crate::limiter::{check, command, Answer, Instead, Limiter};
use crate::local::share_of;

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

fn clock(window: Option<u32>, now_micros: i64) -> Clock {
    let seconds = window.map_or(window::DEFAULT_WINDOW_SECONDS, i64::from);
    Clock::new(seconds, now_micros)
}

/// A limit scaled to this process's share; 0 (no limit) stays 0.
fn local_limit(limit: u64, share: f64) -> i64 {
    if limit == 0 {
        0
    } else {
        i64::try_from(share_of(limit, share)).unwrap_or(i64::MAX)
    }
}

impl<C> Limiter<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
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
        check(|words| window::parse_admit(words), &words)?;
        let remote = async {
            let reply: Vec<i64> = self.module_call(&command(&words)).await?;
            Admission::from_reply(&reply).map_err(|why| Error::Server(why.into()))
        };
        self.run(remote, |instead| {
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
                    let reply = state
                        .windows
                        .admit(&limits, &clock(window, now_micros))
                        .as_reply();
                    let admission = Admission::from_reply(&reply).ok()?;
                    Admission {
                        answered_by: AnsweredBy::Local,
                        ..admission
                    }
                }
            })
        })
        .await
    }

    /// Charges `tokens` to every scope's current window after the response.
    pub async fn record(
        &self,
        keys: &[&str],
        tokens: u64,
        window: Option<u32>,
    ) -> Result<Recorded, Error> {
        let mut words = vec!["QAG.RECORD".to_owned(), keys.len().to_string()];
        words.extend(keys.iter().map(|key| key.to_string()));
        words.push(tokens.to_string());
        push_window(&mut words, window);
        check(|words| window::parse_record(words), &words)?;
        let remote = async {
            let charged: i64 = self.module_call(&command(&words)).await?;
            Ok(Recorded {
                charged: charged.max(0) as u64,
                answered_by: AnsweredBy::Module,
            })
        };
        self.run(remote, |instead| {
            Some(match instead {
                Instead::Forward => Recorded {
                    charged: 0,
                    answered_by: AnsweredBy::Forwarded,
                },
                Instead::Local {
                    state, now_micros, ..
                } => {
                    let tokens = i64::try_from(tokens).unwrap_or(i64::MAX);
                    state
                        .windows
                        .record(keys, tokens, &clock(window, now_micros));
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
