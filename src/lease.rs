//! The lease family: QAG.LEASE, QAG.RENEW, QAG.RELEASE and QAG.LEASES. A key's running
//! queries are a sorted set: members are lease ids, scores their expiry in Unix
//! milliseconds, so a slot held by a crashed process frees itself when its lease runs out.

use std::ffi::CStr;

use qag_core::lease::{self, Acquire};

use crate::command::{Arg, Command, KeyLayout, RawArgs, Reply};
use crate::key::{Access, Key, OwnedString, ValueType};
use crate::server::RawString;
use crate::server::{CommandError, Ctx};
use crate::stats::CallCounters;

/// A key's slots, opened for one call at one instant.
struct Slots<'ctx> {
    key: Key<'ctx>,
    now_millis: i64,
}

impl<'ctx> Slots<'ctx> {
    fn open(
        ctx: &'ctx Ctx,
        args: &RawArgs,
        key: usize,
        access: Access,
    ) -> Result<Self, CommandError> {
        Ok(Slots {
            key: Key::open(ctx, args.string(key), access, ValueType::SortedSet)?,
            now_millis: ctx.now_micros().div_euclid(1000),
        })
    }

    /// The leases that hold no slot: those whose expiry has passed, and those expiring
    /// later than any lease given now could (see `lease::is_live`).
    fn expired(&self) -> Vec<OwnedString> {
        let mut expired = self
            .key
            .zset_range(f64::NEG_INFINITY, false, self.now_millis as f64);
        let latest = lease::latest_expiry(self.now_millis) as f64;
        expired.extend(self.key.zset_range(latest, true, f64::INFINITY));
        expired
    }

    fn holds_live_lease(&self, id: RawString) -> bool {
        self.key
            .zset_score(id)
            .is_some_and(|expiry| lease::is_live(expiry, self.now_millis))
    }

    /// Gives `id` a lease until now + `ttl_millis`, unless it has that one already.
    fn put(&mut self, id: RawString, ttl_millis: i64) {
        let expiry = self.now_millis + ttl_millis;
        if lease::moves(self.key.zset_score(id), expiry) {
            self.key.zset_add(id, expiry);
        }
    }

    /// Makes the key expire with its latest lease, so that an idle key vanishes; a key
    /// the removals emptied is gone already. Members written by others with a later
    /// score hold the key no longer than the longest lease qag gives.
    fn expire_with_latest_lease(&mut self) {
        let Some(latest) = self.key.zset_max_score() else {
            return;
        };
        let limit = self.now_millis + lease::MAX_TTL_MILLIS;
        let at = if latest.is_nan() {
            limit
        } else {
            (latest.ceil() as i64).min(limit)
        };
        self.key.expire_at(at);
    }
}

fn raw_strings(strings: &[OwnedString]) -> Vec<RawString> {
    strings.iter().map(|s| s.raw).collect()
}

static LEASE: CallCounters = CallCounters::new();
static RENEW: CallCounters = CallCounters::new();
static RELEASE: CallCounters = CallCounters::new();
static LEASES: CallCounters = CallCounters::new();

/// QAG.LEASE key max ttl_ms id
pub struct Lease;

impl Command for Lease {
    const NAME: &'static CStr = c"qag.lease";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = 5;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = true;
    const SUMMARY: &'static CStr =
        c"Takes (or renews) one of max concurrency slots for a lease id; replies [acquired, live leases, retry after]";
    const COMPLEXITY: &'static CStr = c"O(log N) plus O(log N) per expired lease removed";
    const ARGS: &'static [Arg] = &[
        Arg::key(c"key", 0),
        Arg::integer(c"max"),
        Arg::integer(c"ttl_ms"),
        Arg::string(c"id"),
    ];
    const COUNTERS: &'static CallCounters = &LEASE;
    const OUTCOMES: &'static [&'static str] = &["acquired", "refused"];

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = lease::parse_lease(args)?;
        let mut slots = Slots::open(ctx, args, call.key, Access::ReadWrite)?;
        let id = args.string(call.id);
        let expired = slots.expired();
        let live = slots.key.len().saturating_sub(expired.len());
        let decision = lease::acquire(call.max, live as u64, slots.holds_live_lease(id));
        if decision == Acquire::Refuse {
            LEASE.allowed_or_refused(false);
            return Ok(Reply::Array([0, live as i64, 1].into()));
        }
        slots.key.zset_remove(&raw_strings(&expired));
        slots.put(id, call.ttl_millis);
        slots.expire_with_latest_lease();
        let live_after = live + usize::from(decision == Acquire::Take);
        LEASE.allowed_or_refused(true);
        Ok(Reply::Array([1, live_after as i64, 0].into()))
    }
}

/// QAG.RENEW key id ttl_ms
pub struct Renew;

impl Command for Renew {
    const NAME: &'static CStr = c"qag.renew";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = 4;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = true;
    const SUMMARY: &'static CStr =
        c"Extends a live lease to now + ttl_ms; replies 1, or 0 when the lease is gone";
    const COMPLEXITY: &'static CStr = c"O(log N) plus O(log N) per expired lease removed";
    const ARGS: &'static [Arg] = &[
        Arg::key(c"key", 0),
        Arg::string(c"id"),
        Arg::integer(c"ttl_ms"),
    ];
    const COUNTERS: &'static CallCounters = &RENEW;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = lease::parse_renew(args)?;
        let mut slots = Slots::open(ctx, args, call.key, Access::ReadWrite)?;
        let id = args.string(call.id);
        if !slots.holds_live_lease(id) {
            return Ok(Reply::Integer(0));
        }
        let expired = slots.expired();
        slots.key.zset_remove(&raw_strings(&expired));
        slots.put(id, call.ttl_millis);
        slots.expire_with_latest_lease();
        Ok(Reply::Integer(1))
    }
}

/// QAG.RELEASE key id
pub struct Release;

impl Command for Release {
    const NAME: &'static CStr = c"qag.release";
    const FLAGS: &'static CStr = c"write fast";
    const ARITY: i32 = 3;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = true;
    const SUMMARY: &'static CStr =
        c"Frees a lease's slot; replies 1 if a live lease was released, else 0";
    const COMPLEXITY: &'static CStr = c"O(log N) plus O(log N) per expired lease removed";
    const ARGS: &'static [Arg] = &[Arg::key(c"key", 0), Arg::string(c"id")];
    const COUNTERS: &'static CallCounters = &RELEASE;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = lease::parse_release(args)?;
        let mut slots = Slots::open(ctx, args, call.key, Access::ReadWrite)?;
        let id = args.string(call.id);
        let Some(expiry) = slots.key.zset_score(id) else {
            return Ok(Reply::Integer(0));
        };
        let live = lease::is_live(expiry, slots.now_millis);
        // The expired leases, the caller's among them if it ran out, go too.
        let expired = slots.expired();
        let mut members = raw_strings(&expired);
        if live {
            members.push(id);
        }
        slots.key.zset_remove(&members);
        slots.expire_with_latest_lease();
        Ok(Reply::Integer(i64::from(live)))
    }
}

/// QAG.LEASES key
pub struct Leases;

impl Command for Leases {
    const NAME: &'static CStr = c"qag.leases";
    const FLAGS: &'static CStr = c"readonly fast";
    const ARITY: i32 = 2;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = false;
    const SUMMARY: &'static CStr = c"Replies the number of live leases at a key";
    const COMPLEXITY: &'static CStr = c"O(log N) plus O(1) per expired lease";
    const ARGS: &'static [Arg] = &[Arg::key(c"key", 0)];
    const COUNTERS: &'static CallCounters = &LEASES;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let key = lease::parse_leases(args)?;
        let slots = Slots::open(ctx, args, key, Access::Read)?;
        let live = slots.key.len().saturating_sub(slots.expired().len());
        Ok(Reply::Integer(live as i64))
    }
}
