//! The lease family: QAG.LEASE, QAG.RENEW, QAG.RELEASE and QAG.LEASES. A key's running
//! queries are a sorted set: members are lease ids, scores their expiry in Unix
//! milliseconds, so a slot held by a crashed process frees itself when its lease runs out.
//! With `WAIT ms`, a LEASE that finds every slot held waits for one, first come first
//! served: a release, a lease running out or any change to the key gives the slots
//! freed to the waiters (wait.rs holds them).

use std::ffi::CStr;

use qag_core::args::ArgList;
use qag_core::lease::{self, Acquire};

use crate::command::{Arg, Command, KeyLayout, RawArgs, Reply, Row, WAIT_ARG};
use crate::key::{Access, Key, OwnedString, ValueType};
use crate::server::RawString;
use crate::server::{CommandError, Ctx};
use crate::stats::CallCounters;
use crate::wait::{self, Held, Serve};

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
        Self::open_at(ctx, args.string(key), access, ctx.now_micros())
    }

    fn open_at(
        ctx: &'ctx Ctx,
        name: RawString,
        access: Access,
        now_micros: i64,
    ) -> Result<Self, CommandError> {
        Ok(Slots {
            key: Key::open(ctx, name, access, ValueType::SortedSet)?,
            now_millis: now_micros.div_euclid(1000),
        })
    }

    /// The live leases.
    fn live(&self) -> usize {
        self.key.len().saturating_sub(self.expired().len())
    }

    /// Takes a slot for `id` (or renews its lease) unless every slot is held: the live
    /// leases after it and whether it took a slot (not renewed one it held), or None.
    fn acquire(&mut self, id: RawString, max: i64, ttl_millis: i64) -> Option<(usize, bool)> {
        let expired = self.expired();
        let live = self.key.len().saturating_sub(expired.len());
        let decision = lease::acquire(max, live as u64, self.holds_live_lease(id));
        if decision == Acquire::Refuse {
            return None;
        }
        self.key.zset_remove(&raw_strings(&expired));
        self.put(id, ttl_millis);
        self.expire_with_latest_lease();
        let took = decision == Acquire::Take;
        Some((live + usize::from(took), took))
    }

    /// When the next live lease runs out, Unix microseconds.
    fn next_expiry(&self) -> Option<i64> {
        let score = self.key.zset_min_score_above(self.now_millis as f64)?;
        lease::is_live(score, self.now_millis).then(|| (score.ceil() as i64).saturating_mul(1000))
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

/// QAG.LEASE key max ttl_ms id [WAIT ms]
pub struct Lease;

impl Command for Lease {
    const NAME: &'static CStr = c"qag.lease";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = -5;
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
        WAIT_ARG,
    ];
    const COUNTERS: &'static CallCounters = &LEASE;
    const OUTCOMES: &'static [&'static str] = &["acquired", "refused"];

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = lease::parse_lease(args)?;
        let now = ctx.now_micros();
        let name = args.get(call.key);
        // Waiters first: a newcomer never takes a slot one of them is owed. They are
        // given slots by a timer a moment later, never inside a command (see wait.rs).
        let owed = wait::slot_waiters(ctx, name);
        if owed > 0 {
            wait::look_again(ctx, name, 0);
        }
        let mut slots = Slots::open_at(ctx, args.string(call.key), Access::ReadWrite, now)?;
        let id = args.string(call.id);
        let reply = |acquired: bool, live: usize, retry: i64| match call.wait {
            Some(_) => Reply::Array(Row::from([i64::from(acquired), live as i64, retry, 0])),
            None => Reply::Array([i64::from(acquired), live as i64, retry].into()),
        };
        let max = call.max.saturating_sub(owed as i64);
        if let Some((live, _)) = slots.acquire(id, max, call.ttl_millis) {
            LEASE.allowed_or_refused(true);
            return Ok(reply(true, live, 0));
        }
        let live = slots.live();
        let next_expiry = slots.next_expiry();
        drop(slots);
        // A call that waits is counted when it is answered: acquired or refused.
        match call.wait {
            Some(ms) if ms > 0 && wait::room(ctx).is_ok() => {
                let held = HeldLease {
                    keys: vec![name.to_vec()],
                    id: args.get(call.id).to_vec(),
                    max: call.max,
                    ttl_millis: call.ttl_millis,
                    granted: false,
                };
                let reply = wait::hold(ctx, Box::new(held), now + ms * 1000, false, None);
                if let Some(at) = next_expiry {
                    wait::look_again(ctx, name, at - now);
                }
                Ok(reply)
            }
            _ => {
                LEASE.allowed_or_refused(false);
                Ok(reply(false, live, 1))
            }
        }
    }
}

/// A LEASE waiting for a slot, given one by the events that free them.
struct HeldLease {
    keys: Vec<Vec<u8>>,
    id: Vec<u8>,
    max: i64,
    ttl_millis: i64,
    /// Whether it took a slot (given back if its answer never reaches its client); a
    /// waiter whose id held a lease already renewed it, and gives nothing back.
    granted: bool,
}

impl Held for HeldLease {
    fn keys(&self) -> &[Vec<u8>] {
        &self.keys
    }

    fn serve(&mut self, ctx: &Ctx, now_micros: i64, waited_ms: i64) -> Serve {
        let name = OwnedString::new(ctx, &self.keys[0]);
        let Ok(mut slots) = Slots::open_at(ctx, name.raw, Access::ReadWrite, now_micros) else {
            // The key holds something else now: no slot will come.
            return Serve::Later(None);
        };
        let id = OwnedString::new(ctx, &self.id);
        match slots.acquire(id.raw, self.max, self.ttl_millis) {
            Some((live, took)) => {
                self.granted = took;
                LEASE.allowed_or_refused(true);
                Serve::Now(Reply::Array(Row::from([1, live as i64, 0, waited_ms])))
            }
            None => Serve::Later(slots.next_expiry()),
        }
    }

    fn refusal(&self, ctx: &Ctx, now_micros: i64, waited_ms: i64) -> Reply {
        LEASE.allowed_or_refused(false);
        let name = OwnedString::new(ctx, &self.keys[0]);
        let live = Slots::open_at(ctx, name.raw, Access::Read, now_micros).map_or(0, |s| s.live());
        Reply::Array(Row::from([0, live as i64, 1, waited_ms]))
    }

    fn give_back(&mut self, ctx: &Ctx, now_micros: i64) -> Vec<(usize, f64)> {
        if self.granted {
            let name = OwnedString::new(ctx, &self.keys[0]);
            if let Ok(mut slots) = Slots::open_at(ctx, name.raw, Access::ReadWrite, now_micros) {
                let id = OwnedString::new(ctx, &self.id);
                if slots.key.zset_score(id.raw).is_some() {
                    slots.key.zset_remove(&[id.raw]);
                    slots.expire_with_latest_lease();
                }
            }
            // A slot freed: the next waiter may take it.
            wait::look_again(ctx, &self.keys[0], 0);
        }
        Vec::new()
    }

    fn sooner(&mut self, _key: usize, _amount: f64) -> Option<i64> {
        None
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
        drop(slots);
        let name = args.get(call.key);
        // Its waiters are given the slot by a timer a moment later (see wait.rs).
        if wait::has_waiters(ctx, name) {
            wait::look_again(ctx, name, 0);
        }
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
        Ok(Reply::Integer(slots.live() as i64))
    }
}
