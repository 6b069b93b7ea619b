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
    /// Counts in this process, each key from Redis's last word on it (a key never seen
    /// answered starts fresh: a full bucket), buckets, leases, quotas and windows
    /// counted per process, all scaled by [`Options::local_share`](crate::Options).
    Local,
}

/// Where a call goes now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    Redis,
    /// The one call that starts the probe of Redis after a back-off (in the
    /// background); it keeps to the policy itself.
    Probe,
    /// Not to Redis: answered by the policy (a back-off runs, or the probe is out).
    Policy,
}

/// The first probe after an outage comes this soon (or at `back_off` if sooner); each
/// that fails doubles the wait, up to `back_off`.
pub(crate) const FIRST_PROBE: Duration = Duration::from_millis(100);

/// The back-off state of one limiter: every call keeps to the policy, and Redis is
/// probed, first [`FIRST_PROBE`] after the outage, then after twice as long each time a
/// probe fails, never more than `back_off` apart. When a probe is due, the first call
/// to arrive is routed to start it; the others keep to the policy until it has
/// answered. The probe that answers ends the back-off: a restart measured in
/// milliseconds costs about `FIRST_PROBE` of answers by the policy, not `back_off`.
/// Only the probe ends a back-off (a call sent before it and answering during it does
/// not). Python's `_policy.Outage` follows the same rules.
#[derive(Debug, Default)]
pub(crate) struct Outage {
    /// When the next probe is due, from an outage until a probe has answered; calls
    /// before it keep to the policy.
    until: Option<Instant>,
    /// The wait before that probe.
    wait: Duration,
    probing: bool,
    /// The outage that started the back-off, for the errors raised during it.
    cause: Option<String>,
}

impl Outage {
    pub(crate) fn route(&mut self, now: Instant) -> Route {
        match self.until {
            None => Route::Redis,
            Some(until) if now < until || self.probing => Route::Policy,
            Some(_) => {
                self.probing = true;
                Route::Probe
            }
        }
    }

    /// The probe found Redis answering (a reply or an error reply): the back-off is
    /// over; true when there was one.
    pub(crate) fn answered(&mut self) -> bool {
        self.probing = false;
        self.cause = None;
        self.until.take().is_some()
    }

    /// Redis failed: a back-off starts, or, its probe failed, the next probe is twice as
    /// far off (a call sent before the back-off and failing during it changes nothing).
    pub(crate) fn failed(&mut self, probe: bool, now: Instant, back_off: Duration, cause: &Error) {
        if probe {
            self.probing = false;
        }
        if back_off.is_zero() {
            return;
        }
        // Options::back_off is any Duration: a day at most, so the instant exists.
        let back_off = back_off.min(Duration::from_secs(86_400));
        self.wait = match self.until {
            None => FIRST_PROBE.min(back_off),
            Some(_) if probe => (self.wait * 2).min(back_off),
            Some(_) => return,
        };
        self.until = Some(now + self.wait);
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
/// one now, and how many it left out since the last. The tower layer's.
#[cfg(feature = "tower")]
#[derive(Debug, Default)]
pub(crate) struct LogEvery {
    last: Option<Instant>,
    left_out: u64,
}

#[cfg(feature = "tower")]
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
        assert_eq!(outage.route(start), Route::Redis);
        outage.failed(false, start, BACK_OFF, &Error::Timeout);
        assert!(outage.backing_off(start));
        // The first probe comes soon: a restart measured in milliseconds costs 0.1 s.
        assert_eq!(
            outage.route(start + Duration::from_millis(99)),
            Route::Policy
        );
        let after = start + FIRST_PROBE;
        assert_eq!(outage.route(after), Route::Probe);
        // Others keep to the policy while the probe is out.
        assert_eq!(outage.route(after), Route::Policy);
        assert!(outage.backing_off(after + Duration::from_secs(60)));
        assert!(outage.answered(), "the probe ends the back-off");
        assert_eq!(outage.route(after), Route::Redis);
        assert!(!outage.backing_off(after));
    }

    #[test]
    fn each_failed_probe_doubles_the_wait_up_to_the_back_off() {
        let start = Instant::now();
        let mut outage = Outage::default();
        outage.failed(false, start, BACK_OFF, &Error::Timeout);
        let mut at = start + FIRST_PROBE;
        assert_eq!(outage.route(at), Route::Probe);
        for wait_ms in [200, 400, 800, 1_600, 3_200, 5_000, 5_000] {
            outage.failed(true, at, BACK_OFF, &Error::Unavailable("refused".into()));
            let wait = Duration::from_millis(wait_ms);
            assert_eq!(
                outage.route(at + wait - Duration::from_millis(1)),
                Route::Policy
            );
            at += wait;
            assert_eq!(outage.route(at), Route::Probe, "{wait_ms}");
        }
        assert!(outage
            .backing_off_error()
            .to_string()
            .contains("backing off after: redis is unavailable: refused"));
        outage.probe_abandoned();
        assert_eq!(outage.route(at), Route::Probe);
        assert!(outage.answered());
        // A new outage starts from the first probe's wait again.
        outage.failed(false, at, BACK_OFF, &Error::Timeout);
        assert_eq!(outage.route(at + FIRST_PROBE), Route::Probe);
    }

    #[test]
    fn concurrent_failures_move_nothing_and_zero_means_none() {
        let start = Instant::now();
        let mut outage = Outage::default();
        outage.failed(false, start, BACK_OFF, &Error::Timeout);
        outage.failed(
            false,
            start + Duration::from_millis(50),
            BACK_OFF,
            &Error::Timeout,
        );
        assert_eq!(outage.route(start + FIRST_PROBE), Route::Probe);

        let mut never = Outage::default();
        never.failed(false, start, Duration::ZERO, &Error::Timeout);
        assert_eq!(never.route(start), Route::Redis);

        let mut short = Outage::default();
        short.failed(false, start, Duration::from_millis(30), &Error::Timeout);
        assert_eq!(
            short.route(start + Duration::from_millis(30)),
            Route::Probe,
            "never later than the back-off"
        );
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

    #[cfg(feature = "tower")]
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
