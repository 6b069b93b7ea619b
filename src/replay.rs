//! Request ids in their keys (`qag_core::replay`): a call given `ID request-id` reads
//! the reply remembered under it, and, when there is none, remembers its own.

use std::sync::atomic::{AtomicI64, Ordering};

use qag_core::args::ArgList;
use qag_core::replay::{self, Answer, AnswerRef, IdArg, Record, Reserved};

use crate::command::{RawArgs, Reply, Row};
use crate::key::{Key, OwnedString};
use crate::server::Ctx;
use crate::server::RawString;

/// ID-SECONDS and ID-MAX: set once when the module loads.
static ID_SECONDS: AtomicI64 = AtomicI64::new(replay::DEFAULT_ID_SECONDS);
static ID_MAX: AtomicI64 = AtomicI64::new(replay::DEFAULT_ID_MAX);

/// Keeps the load arguments; called once when the module loads.
pub fn init(id_seconds: i64, id_max: i64) {
    ID_SECONDS.store(id_seconds, Ordering::Relaxed);
    ID_MAX.store(id_max, Ordering::Relaxed);
}

fn ttl_millis() -> i64 {
    ID_SECONDS.load(Ordering::Relaxed) * 1000
}

/// How long a call's id is remembered: its KEEP, at most ID-SECONDS; else ID-SECONDS.
fn keep_millis(keep_seconds: Option<i64>) -> i64 {
    let ttl = ttl_millis();
    keep_seconds.map_or(ttl, |seconds| seconds.saturating_mul(1000).min(ttl))
}

/// How long a key that remembers ids is kept at the most from now: ID-SECONDS, rounded
/// up to a quarter of it (whole seconds), so that a busy key's expiry moves, and is
/// replicated, once a step rather than on every call; an idle key outlives its last id
/// by a quarter of ID-SECONDS at the most.
pub fn keep_until(now_millis: i64) -> i64 {
    keep_for(now_millis, ttl_millis())
}

/// As [`keep_until`], for an id remembered `keep` ms (a call's KEEP).
fn keep_for(now_millis: i64, keep: i64) -> i64 {
    let step = (keep / 4000).max(1) * 1000;
    (now_millis + keep).div_euclid(step) * step + step
}

/// What a call remembers in its key: the id's field to write with the call's own, and
/// how long the key must be kept for it.
pub struct Remembered {
    id: (OwnedString, OwnedString),
    /// The key's expiry must be no earlier than this.
    pub keep_until: i64,
}

impl Remembered {
    /// The field to write (name, value).
    pub fn field(&self) -> (RawString, RawString) {
        (self.id.0.raw, self.id.1.raw)
    }
}

/// One call's request id, as read from its key.
pub struct RequestId {
    field: OwnedString,
    /// Whether this call looks through the key's ids (`replay::pick`).
    pick: u64,
    /// The reply remembered under it, when the call is a replay.
    remembered: Option<Reply>,
    /// How long the call's reply is to be remembered (ms).
    keep: i64,
}

impl RequestId {
    /// Reads the id `id` of a call of `command` from `key`.
    pub fn read(
        ctx: &Ctx,
        key: &Key,
        command: &str,
        args: &RawArgs,
        id: IdArg,
        now_millis: i64,
    ) -> RequestId {
        let field = RequestId::field(ctx, command, args, id.index);
        let [value] = key.hash_get([field.raw]);
        RequestId::found(field, value, id, now_millis)
    }

    /// The field of the id at argument `index` of a call of `command`, for a caller that
    /// reads it with fields of its own (then [`RequestId::found`]).
    pub fn field(ctx: &Ctx, command: &str, args: &RawArgs, index: usize) -> OwnedString {
        OwnedString::from_text(ctx, |text| {
            replay::field_name(text, command, args.get(index))
        })
    }

    /// The id `id`, from its field's value as read.
    pub fn found(
        field: OwnedString,
        value: Option<OwnedString>,
        id: IdArg,
        now_millis: i64,
    ) -> RequestId {
        let remembered = replay::remembered(value.as_ref().map(OwnedString::bytes), now_millis)
            .map(|record| reply_of(record.answer));
        RequestId {
            pick: replay::pick(field.bytes(), now_millis),
            field,
            remembered,
            keep: keep_millis(id.keep_seconds),
        }
    }

    /// The reply remembered under the id, when the call is a replay, counted as one (a
    /// call that finds it may answer otherwise: a commit, see QAG.RECORD).
    pub fn replay(&self) -> Option<Reply> {
        if self.remembered.is_some() {
            crate::stats::replayed();
        }
        self.remembered
    }

    /// Remembers `reply` under the id until its KEEP (or ID-SECONDS) from now: the fields to write
    /// with the call's own. Looks through the key's ids first, and removes those
    /// forgotten, about once in as many calls as the key has fields, and at its cap.
    pub fn remember(self, ctx: &Ctx, key: &mut Key, reply: &Reply, now_millis: i64) -> Remembered {
        self.remember_until(ctx, key, reply, now_millis, 0)
    }

    /// As [`RequestId::remember`], the reply kept until `until_millis` at least (a
    /// waiter's time: its replay must find what its first call was charged).
    pub fn remember_until(
        self,
        ctx: &Ctx,
        key: &mut Key,
        reply: &Reply,
        now_millis: i64,
        until_millis: i64,
    ) -> Remembered {
        // Only a window's ADMIT reserves: a key of another family holds no reservation.
        self.remember_for(ctx, key, reply, None, now_millis, i64::MIN, until_millis)
    }

    /// The id's field name, for a waiter that forgets it if it gives back its charge.
    pub fn field_bytes(&self) -> Vec<u8> {
        self.field.bytes().to_vec()
    }

    /// Remembers `reply` and the reservation `hold` the call made, until its KEEP (or
    /// ID-SECONDS) from now or, when later, until the hold stops counting. `trusted_until`: the latest a
    /// reservation the key remembers may end (a window's `Clock::trusted_until`), for the
    /// look through its ids.
    pub fn remember_holding(
        self,
        ctx: &Ctx,
        key: &mut Key,
        reply: &Reply,
        hold: Option<Reserved>,
        now_millis: i64,
        trusted_until: i64,
    ) -> Remembered {
        let until = hold.map_or(0, |h| h.until);
        self.remember_for(ctx, key, reply, hold, now_millis, trusted_until, until)
    }

    #[allow(clippy::too_many_arguments)]
    fn remember_for(
        self,
        ctx: &Ctx,
        key: &mut Key,
        reply: &Reply,
        hold: Option<Reserved>,
        now_millis: i64,
        trusted_until: i64,
        until_millis: i64,
    ) -> Remembered {
        let most = ID_MAX.load(Ordering::Relaxed) as usize;
        if replay::looks_through(key.len(), self.pick, most) {
            let ids = key
                .hash_entries_where(&|name| name.starts_with(replay::FIELD_PREFIX))
                .into_iter()
                .map(|(name, value)| {
                    let standing = replay::standing(value.bytes(), now_millis, trusted_until);
                    (name, standing)
                })
                .collect();
            let forget = replay::prune(ids, now_millis, most);
            key.delete_fields(&forget.iter().map(|name| name.raw).collect::<Vec<_>>());
        }
        let forget_at = (now_millis + self.keep).max(until_millis);
        let record = OwnedString::from_text(ctx, |text| {
            replay::encode(text, forget_at, answer_of(reply), hold)
        });
        Remembered {
            id: (self.field, record),
            keep_until: keep_for(now_millis, self.keep).max(forget_at),
        }
    }
}

/// A reservation an earlier QAG.ADMIT remembered, as QAG.RECORD finds it in its first key.
pub struct Reservation {
    field: OwnedString,
    record: Record,
    /// The reservation as remembered.
    pub reserved: Reserved,
    /// Whether it still holds tokens on its scopes (else it expired, was committed, or
    /// ends later than any real hold: only what its partial charges charged is left of
    /// it).
    pub open: bool,
    /// The latest a real hold ends by the call's clock (`Clock::trusted_until`).
    trusted_until: i64,
}

impl Reservation {
    /// The reservation of request id `args[index]` in `key`, made on the chain of keys
    /// `chain` (a RECORD on another chain finds nothing), committed or not, as read at
    /// `now_millis` by a clock that trusts holds ending by `trusted_until`.
    pub fn find(
        ctx: &Ctx,
        key: &Key,
        args: &RawArgs,
        index: usize,
        chain: i64,
        now_millis: i64,
        trusted_until: i64,
    ) -> Option<Reservation> {
        let field = RequestId::field(ctx, "admit", args, index);
        let [value] = key.hash_get([field.raw]);
        let record = replay::remembered(value.as_ref().map(OwnedString::bytes), now_millis)?;
        let reserved = record.hold.filter(|h| h.chain == chain)?;
        Some(Reservation {
            field,
            record,
            reserved,
            open: reserved.holds_at(now_millis, trusted_until),
            trusted_until,
        })
    }

    /// The ADMIT's record after a partial charge of `charged` tokens that released
    /// `released` of the hold, or (None) after the commit, to write with the call's own
    /// fields. Either keeps it remembered for ID-SECONDS more: forgotten, the commit would
    /// charge again what the partials paid, and, once committed, a partial run late or
    /// the commit sent again would charge again.
    pub fn after(
        self,
        ctx: &Ctx,
        partial: Option<(i64, i64)>,
        now_millis: i64,
    ) -> (OwnedString, OwnedString) {
        let forget_at = self.record.forget_at_after_charge(
            &self.reserved,
            now_millis,
            ttl_millis(),
            self.trusted_until,
        );
        let hold = match partial {
            Some((charged, released)) => Reserved {
                tokens: self.reserved.tokens - released,
                charged: self.reserved.charged.saturating_add(charged),
                ..self.reserved
            },
            None => Reserved {
                tokens: 0,
                committed: true,
                ..self.reserved
            },
        };
        let answer = self.record.answer.as_ref();
        let value = OwnedString::from_text(ctx, |text| {
            replay::encode(text, forget_at, answer, Some(hold))
        });
        (self.field, value)
    }
}

fn answer_of(reply: &Reply) -> AnswerRef<'_> {
    match reply {
        Reply::Integer(v) => AnswerRef::Integer(*v),
        Reply::Array(row) => AnswerRef::Row(row.values()),
        Reply::Pair(first, second) => {
            AnswerRef::Pair(first.values(), second.as_ref().map(Row::values))
        }
        // A waiter remembers the answer it will get, never these.
        Reply::Held | Reply::Error(_) => AnswerRef::Row(&[]),
    }
}

fn reply_of(answer: Answer) -> Reply {
    let row = |values: Vec<Option<i64>>| Row::new(&values[..values.len().min(6)]);
    match answer {
        Answer::Integer(v) => Reply::Integer(v),
        Answer::Row(values) => Reply::Array(row(values)),
        Answer::Pair(first, second) => Reply::Pair(row(first), second.map(row)),
    }
}
