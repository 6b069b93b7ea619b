//! Token buckets in this process's memory, for the back-off after Redis failed
//! ([`OnUnavailable::Local`](crate::OnUnavailable::Local)): each bucket starts full and
//! is counted with the module's own arithmetic (qag-core's bucket), so a limit stays
//! enforced per process rather than lifted. Plain code: the clock is an argument.

use std::collections::HashMap;

use qag_core::bucket::{self, Limit, State, Verdict};

/// Buckets tracked before full ones are dropped (a full bucket reads as a missing one).
const PRUNE_ABOVE: usize = 100_000;

#[derive(Default)]
pub struct LocalBuckets {
    buckets: HashMap<String, (State, Limit)>,
}

impl LocalBuckets {
    /// Takes `cost` from the bucket at `key`; `now` in Unix seconds.
    pub fn take(&mut self, key: &str, limit: Limit, cost: i64, now: f64) -> Verdict {
        let stored = self.buckets.get(key).map(|(state, _)| *state);
        let outcome = bucket::take(limit, cost, stored, now);
        if self.buckets.len() >= PRUNE_ABOVE && !self.buckets.contains_key(key) {
            self.prune(now);
        }
        self.buckets.insert(key.to_owned(), (outcome.state, limit));
        outcome.verdict
    }

    /// What `take` would answer, changing nothing.
    pub fn peek(&self, key: &str, limit: Limit, cost: i64, now: f64) -> Verdict {
        let stored = self.buckets.get(key).map(|(state, _)| *state);
        bucket::take(limit, cost, stored, now).verdict
    }

    /// Forgets every bucket: the next back-off starts each one full again.
    pub fn clear(&mut self) {
        self.buckets.clear();
    }

    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Drops the buckets that have refilled completely: they read as full when missing.
    fn prune(&mut self, now: f64) {
        self.buckets.retain(|_, (state, limit)| {
            let refilled = state.tokens + (now - state.ts).max(0.0) * limit.count / limit.period;
            refilled < limit.count
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIVE_A_MINUTE: Limit = Limit {
        count: 5.0,
        period: 60.0,
    };

    #[test]
    fn a_bucket_of_five_refuses_the_sixth_and_refills() {
        let mut local = LocalBuckets::default();
        for left in (0..5).rev() {
            let verdict = local.take("k", FIVE_A_MINUTE, 1, 1000.0);
            assert_eq!(verdict.as_reply(), [1, left, 0]);
        }
        assert_eq!(
            local.take("k", FIVE_A_MINUTE, 1, 1000.0).as_reply(),
            [0, 0, 12]
        );
        assert_eq!(
            local.peek("k", FIVE_A_MINUTE, 1, 1012.0).as_reply(),
            [1, 0, 0]
        );
        assert_eq!(
            local.take("other", FIVE_A_MINUTE, 1, 1000.0).as_reply(),
            [1, 4, 0]
        );
        local.clear();
        assert_eq!(
            local.take("k", FIVE_A_MINUTE, 1, 1000.0).as_reply(),
            [1, 4, 0]
        );
    }

    #[test]
    fn full_buckets_are_pruned_when_the_map_grows() {
        let mut local = LocalBuckets::default();
        for n in 0..PRUNE_ABOVE {
            local.take(&n.to_string(), FIVE_A_MINUTE, 1, 1000.0);
        }
        local.take("late", FIVE_A_MINUTE, 1, 1000.0);
        assert_eq!(local.len(), PRUNE_ABOVE + 1, "nothing has refilled yet");
        local.take("later", FIVE_A_MINUTE, 1, 1012.0);
        assert_eq!(local.len(), 1, "all refilled but the new one");
    }
}
