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
    /// Answered by the policy; no prober runs (it started none, or it was dropped with
    /// its runtime): this call starts one (in the background) and keeps to the policy.
    StartProber,
    /// Not to Redis: answered by the policy (a back-off runs, its prober probes).
    Policy,
}

/// What a back-off's prober does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ProberStep {
    /// Sleep this long, then ask again.
    Wait(Duration),
    /// Probe Redis now.
    Probe,
    /// The back-off is over: the prober ends.
    End,
}

/// The first probe after an outage comes this soon (or at `back_off` if sooner); each
/// that fails doubles the wait, up to `back_off`.
pub(crate) const FIRST_PROBE: Duration = Duration::from_millis(100);

/// The back-off state of one limiter: every call keeps to the policy, and Redis is
/// probed by a prober of its own in the background, first [`FIRST_PROBE`] after the
/// outage, then after twice as long each time a probe fails, never more than `back_off`
/// apart, whether calls come or not: the first burst after a quiet period finds Redis
/// answering if it is back. The probe that answers ends the back-off: a restart
/// measured in milliseconds costs about `FIRST_PROBE` of answers by the policy, not
/// `back_off`. Only the probe ends a back-off (a call sent before it and answering
/// during it does not). One prober a back-off: the outage that starts the back-off
/// starts it, and if it is dropped (its runtime shut down), the next call starts
/// another. Python's `_policy.Outage` follows the same rules.
#[derive(Debug, Default)]
pub(crate) struct Outage {
    /// When the next probe is due, from an outage until a probe has answered; calls
    /// keep to the policy meanwhile.
    until: Option<Instant>,
    /// The wait before that probe.
    wait: Duration,
    /// A prober runs for this back-off.
    prober: bool,
    /// The outage that started the back-off, for the errors raised during it.
    cause: Option<String>,
}

impl Outage {
    pub(crate) fn route(&mut self) -> Route {
        match self.until {
            None => Route::Redis,
            Some(_) if self.prober => Route::Policy,
            Some(_) => {
                self.prober = true;
                Route::StartProber
            }
        }
    }

    /// The prober's next step at `now`.
    pub(crate) fn prober_step(&mut self, now: Instant) -> ProberStep {
        match self.until {
            None => {
                self.prober = false;
                ProberStep::End
            }
            Some(until) if now < until => ProberStep::Wait(until - now),
            Some(_) => ProberStep::Probe,
        }
    }

    /// The probe found Redis answering (a reply or an error reply): the back-off is
    /// over (its prober ends); true when there was one.
    pub(crate) fn answered(&mut self) -> bool {
        self.forget()
    }

    /// The back-off is forgotten (the node it is of is no longer in the cluster's
    /// table: a table that names it again sends calls to it afresh); true when there
    /// was one.
    pub(crate) fn forget(&mut self) -> bool {
        self.prober = false;
        self.cause = None;
        self.until.take().is_some()
    }

    /// Redis failed: a back-off starts, or, its probe failed, the next probe is twice as
    /// far off (a call sent before the back-off and failing during it changes nothing).
    /// True when the caller is to start the back-off's prober.
    pub(crate) fn failed(
        &mut self,
        probe: bool,
        now: Instant,
        back_off: Duration,
        cause: &Error,
    ) -> bool {
        if back_off.is_zero() {
            return false;
        }
        // Options::back_off is any Duration: a day at most, so the instant exists.
        let back_off = back_off.min(Duration::from_secs(86_400));
        self.wait = match self.until {
            None => FIRST_PROBE.min(back_off),
            Some(_) if probe => (self.wait * 2).min(back_off),
            Some(_) => return false,
        };
        self.until = Some(now + self.wait);
        self.cause = Some(cause.to_string());
        !std::mem::replace(&mut self.prober, true)
    }

    /// The prober was dropped before the back-off ended (its runtime shut down): the
    /// next call starts another.
    pub(crate) fn prober_dropped(&mut self) {
        self.prober = false;
    }

    pub(crate) fn backing_off(&self) -> bool {
        self.until.is_some()
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

    /// The probes of an outage that comes at `start`, as its prober makes them while
    /// each fails: the instants of the probes.
    fn probes(outage: &mut Outage, start: Instant, failures: usize) -> Vec<Duration> {
        let mut at = start;
        let mut made = Vec::new();
        while made.len() < failures {
            match outage.prober_step(at) {
                ProberStep::Wait(wait) => at += wait,
                ProberStep::Probe => {
                    made.push(at - start);
                    let refused = Error::Unavailable("refused".into());
                    assert!(!outage.failed(true, at, BACK_OFF, &refused), "one prober");
                }
                ProberStep::End => panic!("ended while failing"),
            }
        }
        made
    }

    #[test]
    fn an_outage_starts_a_prober_that_probes_by_itself_until_redis_answers() {
        let start = Instant::now();
        let mut outage = Outage::default();
        assert_eq!(outage.route(), Route::Redis);
        assert!(
            outage.failed(false, start, BACK_OFF, &Error::Timeout),
            "start one"
        );
        assert!(outage.backing_off());
        // Calls keep to the policy whenever they come: the prober probes without them.
        assert_eq!(outage.route(), Route::Policy);
        assert_eq!(
            outage.prober_step(start),
            ProberStep::Wait(FIRST_PROBE),
            "a restart measured in milliseconds costs 0.1 s"
        );
        let millis = |list: &[u64]| list.iter().map(|&ms| Duration::from_millis(ms)).collect();
        let made: Vec<Duration> = millis(&[100, 300, 700, 1_500, 3_100, 6_300, 11_300, 16_300]);
        assert_eq!(
            probes(&mut outage, start, 8),
            made,
            "doubling up to the back-off"
        );
        assert!(outage
            .backing_off_error()
            .to_string()
            .contains("backing off after: redis is unavailable: refused"));
        // Long after the last probe, with no call meanwhile, the next one is due at once.
        let late = start + Duration::from_secs(3_600);
        assert_eq!(outage.prober_step(late), ProberStep::Probe);
        assert!(outage.answered(), "the probe ends the back-off");
        assert_eq!(outage.route(), Route::Redis);
        assert!(!outage.backing_off());
        assert_eq!(outage.prober_step(late), ProberStep::End);
        // A new outage starts from the first probe's wait again, with a prober of its own.
        assert!(outage.failed(false, late, BACK_OFF, &Error::Timeout));
        assert_eq!(outage.prober_step(late), ProberStep::Wait(FIRST_PROBE));
    }

    #[test]
    fn concurrent_failures_move_nothing_and_zero_means_none() {
        let start = Instant::now();
        let mut outage = Outage::default();
        assert!(outage.failed(false, start, BACK_OFF, &Error::Timeout));
        let later = start + Duration::from_millis(50);
        assert!(!outage.failed(false, later, BACK_OFF, &Error::Timeout));
        assert_eq!(outage.prober_step(later), ProberStep::Wait(FIRST_PROBE / 2));

        let mut never = Outage::default();
        assert!(!never.failed(false, start, Duration::ZERO, &Error::Timeout));
        assert_eq!(never.route(), Route::Redis);

        let mut short = Outage::default();
        assert!(short.failed(false, start, Duration::from_millis(30), &Error::Timeout));
        assert_eq!(
            short.prober_step(start + Duration::from_millis(30)),
            ProberStep::Probe,
            "never later than the back-off"
        );
    }

    /// The events of a back-off's life, in every order up to a length: the flag that
    /// says a prober runs is true exactly while one runs, so at most one runs, and a
    /// back-off without one gets one at the next call.
    #[test]
    fn one_prober_a_back_off_in_every_order_of_its_events() {
        #[derive(Clone, Copy, Debug)]
        enum Event {
            CallFails,
            Call,
            Step,
            ProbeFails,
            ProbeAnswers,
            ProberDropped,
            NodeForgotten,
        }
        const EVENTS: [Event; 7] = [
            Event::CallFails,
            Event::Call,
            Event::Step,
            Event::ProbeFails,
            Event::ProbeAnswers,
            Event::ProberDropped,
            Event::NodeForgotten,
        ];
        // The model: how many probers run, and whether the one that runs has a probe out.
        fn run(schedule: &[Event]) {
            let start = Instant::now();
            let mut outage = Outage::default();
            let (mut probers, mut probing) = (0, false);
            for (n, event) in schedule.iter().enumerate() {
                let now = start + FIRST_PROBE * n as u32;
                match event {
                    Event::CallFails => {
                        probers +=
                            usize::from(outage.failed(false, now, BACK_OFF, &Error::Timeout));
                    }
                    Event::Call => match outage.route() {
                        Route::StartProber => probers += 1,
                        Route::Redis => assert!(!outage.backing_off()),
                        Route::Policy => assert!(outage.backing_off()),
                    },
                    Event::Step if probers == 1 && !probing => match outage.prober_step(now) {
                        ProberStep::Probe => probing = true,
                        ProberStep::Wait(wait) => assert!(!wait.is_zero() && wait <= BACK_OFF),
                        ProberStep::End => probers -= 1,
                    },
                    Event::ProbeFails if probing => {
                        let refused = Error::Unavailable("refused".into());
                        assert!(!outage.failed(true, now, BACK_OFF, &refused));
                        probing = false;
                    }
                    Event::ProbeAnswers if probing => {
                        assert!(outage.answered());
                        (probers, probing) = (0, false); // it ends at once
                    }
                    Event::ProberDropped if probers == 1 => {
                        outage.prober_dropped();
                        (probers, probing) = (0, false);
                    }
                    Event::NodeForgotten if probers == 1 && !probing => {
                        assert!(outage.forget());
                        probers = 0;
                    }
                    _ => {} // not a possible event now
                }
                assert!(probers <= 1, "{schedule:?}");
                assert_eq!(outage.prober, probers == 1, "{schedule:?}");
                if outage.backing_off() && probers == 0 {
                    assert_eq!(outage.route(), Route::StartProber, "{schedule:?}");
                    probers += 1;
                }
            }
        }
        let mut schedules: Vec<Vec<Event>> = vec![Vec::new()];
        let mut tried = 0;
        for _ in 0..6 {
            let mut longer = Vec::new();
            for schedule in &schedules {
                for event in EVENTS {
                    let mut next = schedule.clone();
                    next.push(event);
                    run(&next);
                    tried += 1;
                    longer.push(next);
                }
            }
            schedules = longer;
        }
        assert_eq!(tried, (1..=6).map(|n| 7_usize.pow(n)).sum::<usize>());
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
