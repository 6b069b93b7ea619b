//! What a limiter does when Redis fails, in one place for every family: which calls go
//! to Redis (none during a back-off, one probe after it), what answers instead (the
//! typed error, a forwarded answer or a local one), and the counts of how calls were
//! answered. Plain code: the clock is an argument.

use std::time::{Duration, Instant};

use crate::decision::AnsweredBy;
use crate::error::Error;

/// What a call does when Redis is unreachable or too slow, and for `back_off` after
/// that without touching Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnUnavailable {
    /// The typed error ([`Error::Unavailable`] or [`Error::Timeout`]); during the
    /// back-off [`Error::Unavailable`] at once, so an outage costs at most one deadline
    /// per back-off.
    #[default]
    Raise,
    /// Answers "not counted, forwarded" ([`AnsweredBy::Forwarded`]): the caller lets
    /// the request through uncounted (ADR 0032's data plane).
    Forward,
    /// Counts in this process: buckets start full, leases, quotas and windows are
    /// counted per process, all scaled by [`Options::local_share`](crate::Options).
    Local,
}

/// Where a call goes now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// To Redis; `probe` when it is the one call trying Redis after a back-off.
    Redis { probe: bool },
    /// Not to Redis: answered by the policy (a back-off runs, or a probe is out).
    Policy,
}

/// The back-off state of one limiter.
#[derive(Debug, Default)]
pub(crate) struct Outage {
    /// Set from an outage until a probe has answered; calls before it keep to the policy.
    until: Option<Instant>,
    probing: bool,
    /// The outage that started the back-off, for the errors raised during it.
    cause: Option<String>,
}

impl Outage {
    pub(crate) fn route(&mut self, now: Instant) -> Route {
        match self.until {
            None => Route::Redis { probe: false },
            Some(until) if now < until || self.probing => Route::Policy,
            Some(_) => {
                self.probing = true;
                Route::Redis { probe: true }
            }
        }
    }

    /// Redis answered (a reply or an error reply): true when that ended a back-off.
    pub(crate) fn answered(&mut self, probe: bool) -> bool {
        if probe {
            self.probing = false;
            self.cause = None;
            return self.until.take().is_some();
        }
        false
    }

    /// Redis failed: a back-off starts (or goes on) until `now + back_off`.
    pub(crate) fn failed(&mut self, probe: bool, now: Instant, back_off: Duration, cause: &Error) {
        if probe {
            self.probing = false;
        }
        if back_off.is_zero() {
            return;
        }
        // Options::back_off is any Duration: a day at most, so the instant exists.
        let until = now + back_off.min(Duration::from_secs(86_400));
        self.until = Some(self.until.map_or(until, |current| current.max(until)));
        self.cause = Some(cause.to_string());
    }

    /// A probe that ended without an answer (its future was dropped): the next call probes.
    pub(crate) fn probe_abandoned(&mut self) {
        self.probing = false;
    }

    pub(crate) fn backing_off(&self, now: Instant) -> bool {
        self.until.is_some_and(|until| now < until || self.probing)
    }

    /// The error `Raise` answers while Redis is left alone.
    pub(crate) fn backing_off_error(&self) -> Error {
        Error::Unavailable(
            format!(
                "backing off after: {}",
                self.cause.as_deref().unwrap_or("an outage")
            )
            .into(),
        )
    }
}

/// How many calls were answered each way since the limiter was built (for metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub module: u64,
    pub script: u64,
    pub local: u64,
    pub forwarded: u64,
    /// Calls that returned an error, and background releases or renewals that failed.
    pub errors: u64,
}

impl Counts {
    pub(crate) fn count(&mut self, answered_by: AnsweredBy) {
        let counter = match answered_by {
            AnsweredBy::Module => &mut self.module,
            AnsweredBy::Script => &mut self.script,
            AnsweredBy::Local => &mut self.local,
            AnsweredBy::Forwarded => &mut self.forwarded,
        };
        *counter += 1;
    }

    /// Another node's counts added (a cluster's are its nodes' together).
    pub(crate) fn add(&mut self, other: &Counts) {
        self.module += other.module;
        self.script += other.script;
        self.local += other.local;
        self.forwarded += other.forwarded;
        self.errors += other.errors;
    }
}

/// At most one log line per `every` for an event that may repeat thousands of times a
/// second (requests answered 503 in an outage): [`LogEvery::due`] says whether to write
/// one now, and how many it left out since the last.
#[derive(Debug, Default)]
pub(crate) struct LogEvery {
    last: Option<Instant>,
    left_out: u64,
}

impl LogEvery {
    /// None while it is too soon (the event counted), else how many were left out.
    pub(crate) fn due(&mut self, now: Instant, every: Duration) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < every => {
                self.left_out += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.left_out))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BACK_OFF: Duration = Duration::from_secs(5);

    #[test]
    fn an_outage_leaves_redis_alone_then_lets_one_probe_through() {
        let start = Instant::now();
        let mut outage = Outage::default();
        assert_eq!(outage.route(start), Route::Redis { probe: false });
        outage.failed(false, start, BACK_OFF, &Error::Timeout);
        assert!(outage.backing_off(start));
        assert_eq!(outage.route(start + Duration::from_secs(4)), Route::Policy);
        let after = start + BACK_OFF;
        assert_eq!(outage.route(after), Route::Redis { probe: true });
        // Others keep to the policy while the probe is out.
        assert_eq!(outage.route(after), Route::Policy);
        assert!(outage.backing_off(after + Duration::from_secs(60)));
        assert!(outage.answered(true), "the probe ends the back-off");
        assert_eq!(outage.route(after), Route::Redis { probe: false });
        assert!(!outage.backing_off(after));
    }

    #[test]
    fn a_failed_probe_starts_a_new_back_off_and_an_abandoned_one_frees_the_slot() {
        let start = Instant::now();
        let mut outage = Outage::default();
        outage.failed(false, start, BACK_OFF, &Error::Timeout);
        let after = start + BACK_OFF;
        assert_eq!(outage.route(after), Route::Redis { probe: true });
        outage.failed(true, after, BACK_OFF, &Error::Unavailable("refused".into()));
        assert_eq!(outage.route(after + Duration::from_secs(1)), Route::Policy);
        assert!(outage
            .backing_off_error()
            .to_string()
            .contains("backing off after: redis is unavailable: refused"));
        let later = after + BACK_OFF;
        assert_eq!(outage.route(later), Route::Redis { probe: true });
        outage.probe_abandoned();
        assert_eq!(outage.route(later), Route::Redis { probe: true });
    }

    #[test]
    fn only_the_probe_ends_a_back_off() {
        let start = Instant::now();
        let mut outage = Outage::default();
        outage.failed(false, start, BACK_OFF, &Error::Timeout);
        // A call sent before the outage answers during the back-off.
        assert!(!outage.answered(false));
        assert_eq!(outage.route(start), Route::Policy);
    }

    #[test]
    fn concurrent_failures_extend_one_back_off_and_zero_means_none() {
        let start = Instant::now();
        let mut outage = Outage::default();
        outage.failed(false, start, BACK_OFF, &Error::Timeout);
        outage.failed(
            false,
            start + Duration::from_secs(1),
            BACK_OFF,
            &Error::Timeout,
        );
        assert_eq!(outage.route(start + BACK_OFF), Route::Policy);
        assert_eq!(
            outage.route(start + Duration::from_secs(6)),
            Route::Redis { probe: true }
        );

        let mut never = Outage::default();
        never.failed(false, start, Duration::ZERO, &Error::Timeout);
        assert_eq!(never.route(start), Route::Redis { probe: false });

        let mut long = Outage::default();
        long.failed(false, start, Duration::MAX, &Error::Timeout);
        assert_eq!(long.route(start + Duration::from_secs(3600)), Route::Policy);
    }

    #[test]
    fn counts_each_way() {
        let mut counts = Counts::default();
        for by in [
            AnsweredBy::Module,
            AnsweredBy::Module,
            AnsweredBy::Script,
            AnsweredBy::Local,
            AnsweredBy::Forwarded,
        ] {
            counts.count(by);
        }
        assert_eq!(
            counts,
            Counts {
                module: 2,
                script: 1,
                local: 1,
                forwarded: 1,
                errors: 0
            }
        );
    }

    #[test]
    fn a_repeated_log_line_is_written_once_a_second_with_what_it_left_out() {
        let (start, second) = (Instant::now(), Duration::from_secs(1));
        let mut log = LogEvery::default();
        assert_eq!(log.due(start, second), Some(0));
        for millis in [100, 500, 990] {
            assert_eq!(log.due(start + Duration::from_millis(millis), second), None);
        }
        assert_eq!(log.due(start + second, second), Some(3));
        assert_eq!(log.due(start + Duration::from_millis(1500), second), None);
        assert_eq!(log.due(start + Duration::from_secs(5), second), Some(1));
    }
}
