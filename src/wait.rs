//! Waiters (`WAIT ms`): callers the module keeps blocked until their call fits, then
//! answers, as BLPOP answers when a list fills. Each family's waiting call is a [`Held`]:
//! a timed one (a token bucket's, a throttle's: charged when it arrives, answered at the
//! time its tokens exist) is answered by a timer at that time; a slot waiter (a lease's)
//! is answered by the events that free a slot (a release, a lease running out, any
//! change to its key), and refused by a timer when its wait runs out. Waiters of one key
//! are kept in arrival order: a timed one is served in that order by construction (each
//! charged the key before the next), slot waiters are given slots in that order.
//!
//! A waiter that is not served (its client gone, CLIENT UNBLOCK, or its answer never
//! delivered) gives back what it was charged, in a timer of its own a moment later (never
//! inside the server's handling of the client's end), and the timed waiters behind it on
//! its keys come that much sooner. Everything here runs on the server's main thread.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicI64, Ordering};

use qag_core::wait::{millis_up, DEFAULT_MAX_WAITERS};
use redis_module::raw;

use crate::command::{guarded, Reply};
use crate::server::{string_bytes, Ctx};
use crate::stats::WAITS;

/// MAX-WAITERS: set once when the module loads.
static MAX_WAITERS: AtomicI64 = AtomicI64::new(DEFAULT_MAX_WAITERS);

/// Sets how many clients the server keeps waiting at most; called at load.
pub fn set_max_waiters(most: i64) {
    MAX_WAITERS.store(most, Ordering::Relaxed);
}

/// How a held call is served now.
pub enum Serve {
    Now(Reply),
    /// Not yet (a slot waiter finding every slot held); when to look again, Unix
    /// microseconds, if something but an event frees one then (a lease running out).
    Later(Option<i64>),
}

/// A call the module holds until it fits: each family's waiting call.
pub trait Held {
    /// Its keys, in the database it was called in; a request id lives in the first.
    fn keys(&self) -> &[Vec<u8>];
    /// Serves it now, `waited_ms` after it arrived: a timed call at its time always is.
    fn serve(&mut self, ctx: &Ctx, now_micros: i64, waited_ms: i64) -> Serve;
    /// Its answer when it stops waiting unserved: its wait ran out, or CLIENT UNBLOCK.
    fn refusal(&self, ctx: &Ctx, now_micros: i64, waited_ms: i64) -> Reply;
    /// Gives back what it holds, its answer never delivered: per key (an index into
    /// `keys`), what the waiters behind it there are given (`Held::sooner`'s amount).
    fn give_back(&mut self, ctx: &Ctx, now_micros: i64) -> Vec<(usize, f64)>;
    /// A waiter ahead of it on its key `key` gave back `amount` (tokens, or a throttle's
    /// nanoseconds): its new time, Unix microseconds, if that moved it.
    fn sooner(&mut self, key: usize, amount: f64) -> Option<i64>;
}

/// Why a call cannot wait here and answers at once, as without WAIT.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum NoRoom {
    /// Inside MULTI/EXEC, a script, or a call a module made: no client to block.
    NotHere,
    /// MAX-WAITERS are waiting already.
    Full,
}

struct Waiter {
    client: *mut raw::RedisModuleBlockedClient,
    db: c_int,
    arrived_micros: i64,
    /// Its timer: a timed waiter's time, or a slot waiter's end of wait.
    timer: raw::RedisModuleTimerID,
    timed: bool,
    held: Box<dyn Held>,
}

/// A waiter's answer on its way to its client: if the client is gone before it gets
/// it, what it was given is given back.
struct Delivery {
    reply: Reply,
    delivered: bool,
    db: c_int,
    /// The waiter's arrival order, for whom its give-back moves sooner.
    seq: u64,
    held: Option<Box<dyn Held>>,
}

/// A give-back waiting for its timer.
struct GiveBack {
    db: c_int,
    seq: u64,
    held: Box<dyn Held>,
}

type KeyName = (c_int, Vec<u8>);

#[derive(Default)]
struct Registry {
    /// Arrival order: every waiter's number is above those of the waiters before it.
    next_seq: u64,
    waiters: HashMap<u64, Waiter>,
    by_client: HashMap<usize, u64>,
    /// Each key's waiters, in arrival order.
    queues: HashMap<KeyName, VecDeque<u64>>,
    /// Keys whose slot waiters are to be looked at, by the timer that will and when
    /// (Unix microseconds).
    checks: HashMap<KeyName, (raw::RedisModuleTimerID, i64)>,
    /// Give-backs the next `on_give_backs` makes, and whether its timer runs.
    give_backs: Vec<GiveBack>,
    give_back_timer: bool,
    /// Whether the module is subscribed to the keyspace events that free a slot: only
    /// while slot waiters may be waiting, since every subscribed event on any key costs
    /// the server a context of its own (about 600 instructions).
    watching: bool,
}

thread_local! {
    static REGISTRY: RefCell<Registry> = RefCell::new(Registry::default());
}

fn with<T>(f: impl FnOnce(&mut Registry) -> T) -> T {
    REGISTRY.with(|registry| f(&mut registry.borrow_mut()))
}

/// Whether a call may wait here now: a client that can be blocked, and room for it.
pub fn room(ctx: &Ctx) -> Result<(), NoRoom> {
    let denied = raw::REDISMODULE_CTX_FLAGS_MULTI
        | raw::REDISMODULE_CTX_FLAGS_LUA
        | raw::REDISMODULE_CTX_FLAGS_DENY_BLOCKING;
    // SAFETY: a live command context.
    let flags = unsafe { raw::RedisModule_GetContextFlags.unwrap()(ctx.raw()) } as u32;
    if flags & denied != 0 {
        return Err(NoRoom::NotHere);
    }
    let waiting = with(|r| r.waiters.len()) as i64;
    if waiting >= MAX_WAITERS.load(Ordering::Relaxed) {
        WAITS.full();
        return Err(NoRoom::Full);
    }
    Ok(())
}

/// Whether `key` (of the calling client's database) has waiters.
pub fn has_waiters(ctx: &Ctx, key: &[u8]) -> bool {
    with(|r| !r.queues.is_empty() && r.queues.contains_key(&(selected_db(ctx), key.to_vec())))
}

fn selected_db(ctx: &Ctx) -> c_int {
    // SAFETY: a live context.
    unsafe { raw::RedisModule_GetSelectedDb.unwrap()(ctx.raw()) }
}

/// Blocks the calling client until `held` is served: at `due_micros` by its timer when
/// `timed`, else by the events that free a slot on its key, refused at `due_micros`.
/// `room` must have said yes. The command replies nothing now.
pub fn hold(ctx: &Ctx, held: Box<dyn Held>, due_micros: i64, timed: bool) -> Reply {
    let now = ctx.now_micros();
    // SAFETY: a live command context, `room` checked; no timeout (0): timers end each
    // wait, and the timeout callback answers CLIENT UNBLOCK.
    let client = unsafe {
        raw::RedisModule_BlockClient.unwrap()(
            ctx.raw(),
            Some(on_reply),
            Some(on_unblocked),
            Some(on_free),
            0,
        )
    };
    // SAFETY: the client just blocked.
    unsafe { raw::RedisModule_SetDisconnectCallback.unwrap()(client, Some(on_disconnect)) };
    let db = selected_db(ctx);
    if !timed {
        watch_keys(ctx);
    }
    with(|r| {
        r.next_seq += 1;
        let seq = r.next_seq;
        for key in held.keys() {
            r.queues
                .entry((db, key.clone()))
                .or_default()
                .push_back(seq);
        }
        let timer = start_timer(ctx, due_micros - now, on_due, seq);
        r.by_client.insert(client as usize, seq);
        r.waiters.insert(
            seq,
            Waiter {
                client,
                db,
                arrived_micros: now,
                timer,
                timed,
                held,
            },
        );
    });
    WAITS.started();
    Reply::Held
}

fn start_timer(
    ctx: &Ctx,
    in_micros: i64,
    callback: extern "C" fn(*mut raw::RedisModuleCtx, *mut c_void),
    data: u64,
) -> raw::RedisModuleTimerID {
    // SAFETY: a live context; the data is a number, never dereferenced.
    unsafe {
        raw::RedisModule_CreateTimer.unwrap()(
            ctx.raw(),
            millis_up(in_micros.max(0)),
            Some(callback),
            data as usize as *mut c_void,
        )
    }
}

fn stop_timer(ctx: &Ctx, timer: raw::RedisModuleTimerID) {
    // SAFETY: a live context; a timer that fired already is simply not found.
    unsafe { raw::RedisModule_StopTimer.unwrap()(ctx.raw(), timer, std::ptr::null_mut()) };
}

/// Takes waiter `seq` out of the registry and its keys' queues.
fn remove(r: &mut Registry, seq: u64) -> Option<Waiter> {
    let waiter = r.waiters.remove(&seq)?;
    r.by_client.remove(&(waiter.client as usize));
    for key in waiter.held.keys() {
        let name = (waiter.db, key.clone());
        if let Some(queue) = r.queues.get_mut(&name) {
            queue.retain(|&other| other != seq);
            if queue.is_empty() {
                r.queues.remove(&name);
            }
        }
    }
    Some(waiter)
}

/// Answers a waiter's client with `reply` (what it holds kept in the delivery, given
/// back if the answer never reaches the client).
fn deliver(waiter: Waiter, seq: u64, reply: Reply, holds: bool) {
    let delivery = Delivery {
        reply,
        delivered: false,
        db: waiter.db,
        seq,
        held: holds.then_some(waiter.held),
    };
    let data = Box::into_raw(Box::new(delivery)).cast::<c_void>();
    // SAFETY: a client this module blocked and has not unblocked; on_free takes the
    // delivery back.
    unsafe { raw::RedisModule_UnblockClient.unwrap()(waiter.client, data) };
}

/// Serves a waiter now (its time came), or refuses it (its wait ran out).
fn serve_or_refuse(ctx: &Ctx, seq: u64) {
    let Some(mut waiter) = with(|r| remove(r, seq)) else {
        return;
    };
    let now = clock();
    let waited = (now - waiter.arrived_micros).max(0) / 1000;
    select_db(ctx, waiter.db);
    let answer = match waiter.timed {
        true => match waiter.held.serve(ctx, now, waited) {
            Serve::Now(reply) => Some(reply),
            Serve::Later(_) => None,
        },
        false => None,
    };
    match answer {
        Some(reply) => {
            WAITS.served(waited);
            deliver(waiter, seq, reply, true);
        }
        None => {
            let reply = waiter.held.refusal(ctx, now, waited);
            WAITS.timed_out();
            deliver(waiter, seq, reply, false);
        }
    }
}

fn select_db(ctx: &Ctx, db: c_int) {
    // SAFETY: a live context; a database the waiter's client had selected.
    unsafe { raw::RedisModule_SelectDb.unwrap()(ctx.raw(), db) };
}

/// Gives slots to the slot waiters of `key` (the calling client's database), first come
/// first served, while they fit, at `now` (Unix microseconds); then looks again when a
/// lease is due to run out. Called after a release, when a lease runs out, on any change
/// to the key, and before a new QAG.LEASE decides (so it never takes a slot ahead of a
/// waiter).
pub fn serve_slots(ctx: &Ctx, key: &[u8], now: i64) {
    let db = selected_db(ctx);
    let name = (db, key.to_vec());
    loop {
        let Some(seq) = with(|r| slot_waiter_first(r, &name)) else {
            return;
        };
        let Some(mut waiter) = with(|r| remove(r, seq)) else {
            return;
        };
        let waited = (now - waiter.arrived_micros).max(0) / 1000;
        match waiter.held.serve(ctx, now, waited) {
            Serve::Now(reply) => {
                stop_timer(ctx, waiter.timer);
                WAITS.served(waited);
                deliver(waiter, seq, reply, true);
            }
            Serve::Later(look_again) => {
                // Back where it was, first.
                with(|r| {
                    r.by_client.insert(waiter.client as usize, seq);
                    for key in waiter.held.keys() {
                        r.queues
                            .entry((db, key.clone()))
                            .or_default()
                            .push_front(seq);
                    }
                    r.waiters.insert(seq, waiter);
                });
                if let Some(at) = look_again {
                    check_at(ctx, name, at - now);
                }
                return;
            }
        }
    }
}

/// The first waiter of a key of slot waiters (a key of timed waiters has none: its
/// timers serve them).
fn slot_waiter_first(r: &Registry, name: &KeyName) -> Option<u64> {
    let seq = r.queues.get(name)?.front().copied()?;
    r.waiters
        .get(&seq)
        .filter(|waiter| !waiter.timed)
        .map(|_| seq)
}

/// Looks at the slot waiters of `key` (the calling client's database) in `in_micros`:
/// when a lease is due to run out, or at once after a slot was freed outside a command.
pub fn look_again(ctx: &Ctx, key: &[u8], in_micros: i64) {
    check_at(ctx, (selected_db(ctx), key.to_vec()), in_micros);
}

/// Looks at a key's slot waiters in `in_micros` (one timer a key: the sooner wins).
fn check_at(ctx: &Ctx, name: KeyName, in_micros: i64) {
    let at = clock() + in_micros;
    let later = with(|r| match r.checks.get(&name) {
        Some(&(_, due)) if due <= at => None,
        Some(_) => r.checks.remove(&name),
        None => Some((0, 0)),
    });
    let Some((stale, _)) = later else {
        return;
    };
    if stale != 0 {
        // SAFETY: a timer check_at made for this key, its name boxed: taken back here.
        let mut data = std::ptr::null_mut();
        unsafe { raw::RedisModule_StopTimer.unwrap()(ctx.raw(), stale, &mut data) };
        if !data.is_null() {
            drop(unsafe { Box::from_raw(data.cast::<KeyName>()) });
        }
    }
    let data = Box::into_raw(Box::new(name.clone())).cast::<c_void>();
    // SAFETY: a live context; on_check takes the name back.
    let timer = unsafe {
        raw::RedisModule_CreateTimer.unwrap()(
            ctx.raw(),
            millis_up(in_micros.max(0)),
            Some(on_check),
            data,
        )
    };
    with(|r| r.checks.insert(name, (timer, at)));
}

/// A key of waiters changed (a keyspace event): its slot waiters are looked at a
/// moment later, outside the event (no write may be made inside it).
extern "C" fn on_key_event(
    ctx: *mut raw::RedisModuleCtx,
    _type: c_int,
    _event: *const std::ffi::c_char,
    key: *mut raw::RedisModuleString,
) -> c_int {
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        if with(|r| r.queues.is_empty()) {
            return;
        }
        // SAFETY: the event's key, live for the callback.
        let name = (selected_db(&ctx), unsafe { string_bytes(key) }.to_vec());
        if with(|r| slot_waiter_first(r, &name).is_some()) {
            check_at(&ctx, name, 0);
        }
    });
    raw::REDISMODULE_OK as c_int
}

/// The events that may free a slot: a member removed, a key deleted, expired or evicted.
const SLOT_EVENTS: c_int = (raw::REDISMODULE_NOTIFY_ZSET
    | raw::REDISMODULE_NOTIFY_GENERIC
    | raw::REDISMODULE_NOTIFY_EXPIRED
    | raw::REDISMODULE_NOTIFY_EVICTED) as c_int;

/// How often, while subscribed, the module looks whether any slot waiter is left.
const QUIET_CHECK_MS: i64 = 1000;

/// Subscribes to [`SLOT_EVENTS`] when the first slot waiter blocks. Where the server can
/// unsubscribe (Redis 8 of those tested), a timer unsubscribes once none is left;
/// elsewhere (Redis 7.0, Valkey 8 and 9) the subscription stays until the module unloads.
fn watch_keys(ctx: &Ctx) {
    if with(|r| std::mem::replace(&mut r.watching, true)) {
        return;
    }
    // SAFETY: a live command context; checked present at load.
    unsafe {
        raw::RedisModule_SubscribeToKeyspaceEvents.unwrap()(
            ctx.raw(),
            SLOT_EVENTS,
            Some(on_key_event),
        )
    };
    if unsafe { raw::RedisModule_UnsubscribeFromKeyspaceEvents }.is_some() {
        start_timer(ctx, QUIET_CHECK_MS * 1000, on_quiet_check, 0);
    }
}

/// Unsubscribes when no slot waiter is left, else looks again later. A timer, never
/// inside an event: the server still uses a subscription after its callback returns.
extern "C" fn on_quiet_check(ctx: *mut raw::RedisModuleCtx, _data: *mut c_void) {
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        if with(|r| r.waiters.values().any(|waiter| !waiter.timed)) {
            start_timer(&ctx, QUIET_CHECK_MS * 1000, on_quiet_check, 0);
            return;
        }
        // SAFETY: a live timer context; the same events and callback as subscribed.
        let unsubscribe = unsafe { raw::RedisModule_UnsubscribeFromKeyspaceEvents }.unwrap();
        unsafe { unsubscribe(ctx.raw(), SLOT_EVENTS, Some(on_key_event)) };
        with(|r| r.watching = false);
    });
}

extern "C" fn on_check(ctx: *mut raw::RedisModuleCtx, data: *mut c_void) {
    // SAFETY: the name check_at boxed for this timer, taken back once.
    let name = unsafe { Box::from_raw(data.cast::<KeyName>()) };
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        with(|r| r.checks.remove(&*name));
        select_db(&ctx, name.0);
        serve_slots(&ctx, &name.1, clock());
    });
}

extern "C" fn on_due(ctx: *mut raw::RedisModuleCtx, data: *mut c_void) {
    let _ = guarded(|| serve_or_refuse(&Ctx(ctx), data as usize as u64));
}

/// The reply callback: a served (or refused) waiter's answer.
extern "C" fn on_reply(
    ctx: *mut raw::RedisModuleCtx,
    _argv: *mut *mut raw::RedisModuleString,
    _argc: c_int,
) -> c_int {
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        // SAFETY: the delivery this module gave RM_UnblockClient, freed by on_free.
        let delivery = unsafe { raw::RedisModule_GetBlockedClientPrivateData.unwrap()(ctx.raw()) }
            .cast::<Delivery>();
        if let Some(delivery) = unsafe { delivery.as_mut() } {
            ctx.reply(delivery.reply);
            delivery.delivered = true;
        }
    });
    raw::REDISMODULE_OK as c_int
}

/// Frees a delivery; one its client never got gives back what it was given.
extern "C" fn on_free(ctx: *mut raw::RedisModuleCtx, data: *mut c_void) {
    // SAFETY: the delivery boxed in `deliver`, freed once here.
    let delivery = unsafe { Box::from_raw(data.cast::<Delivery>()) };
    let _ = guarded(move || {
        if let (false, Some(held)) = (delivery.delivered, delivery.held) {
            give_back_later(&Ctx(ctx), delivery.db, delivery.seq, held, false);
        }
    });
}

/// CLIENT UNBLOCK on a waiter: refused now, what it was charged given back.
extern "C" fn on_unblocked(
    ctx: *mut raw::RedisModuleCtx,
    _argv: *mut *mut raw::RedisModuleString,
    _argc: c_int,
) -> c_int {
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        // SAFETY: the timeout callback's context holds its blocked client.
        let client = unsafe { raw::RedisModule_GetBlockedClientHandle.unwrap()(ctx.raw()) };
        let Some((seq, waiter)) = take_by_client(client) else {
            return;
        };
        stop_timer(&ctx, waiter.timer);
        let now = clock();
        let waited = (now - waiter.arrived_micros).max(0) / 1000;
        ctx.reply(waiter.held.refusal(&ctx, now, waited));
        give_back_later(&ctx, waiter.db, seq, waiter.held, true);
        // SAFETY: the client, unblocked by the server after this callback; this frees
        // the module's handle.
        unsafe { raw::RedisModule_UnblockClient.unwrap()(client, std::ptr::null_mut()) };
    });
    raw::REDISMODULE_OK as c_int
}

/// A waiter's client disconnected: what it was charged is given back.
extern "C" fn on_disconnect(
    ctx: *mut raw::RedisModuleCtx,
    client: *mut raw::RedisModuleBlockedClient,
) {
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        if let Some((seq, waiter)) = take_by_client(client) {
            stop_timer(&ctx, waiter.timer);
            give_back_later(&ctx, waiter.db, seq, waiter.held, true);
        }
        // SAFETY: a client this module blocked; this frees the module's handle.
        unsafe { raw::RedisModule_UnblockClient.unwrap()(client, std::ptr::null_mut()) };
    });
}

fn take_by_client(client: *mut raw::RedisModuleBlockedClient) -> Option<(u64, Waiter)> {
    with(|r| {
        let seq = r.by_client.get(&(client as usize)).copied()?;
        remove(r, seq).map(|waiter| (seq, waiter))
    })
}

/// Queues a give-back for the next turn of the event loop (`ctx`: any context of the
/// module's, a timer needs no more).
fn give_back_later(ctx: &Ctx, db: c_int, seq: u64, held: Box<dyn Held>, waiting: bool) {
    WAITS.given_back(waiting);
    let start = with(|r| {
        r.give_backs.push(GiveBack { db, seq, held });
        !std::mem::replace(&mut r.give_back_timer, true)
    });
    if start {
        start_timer(ctx, 0, on_give_backs, 0);
    }
}

/// The wall clock, Unix microseconds: outside a command, the server's cached time may be
/// as old as its last command or cron run.
fn clock() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec * 1_000_000 + ts.tv_nsec / 1000
}

extern "C" fn on_give_backs(ctx: *mut raw::RedisModuleCtx, _data: *mut c_void) {
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        let give_backs = with(|r| {
            r.give_back_timer = false;
            std::mem::take(&mut r.give_backs)
        });
        for GiveBack { db, seq, mut held } in give_backs {
            select_db(&ctx, db);
            let now = clock();
            for (key, amount) in held.give_back(&ctx, now) {
                let Some(name) = held.keys().get(key) else {
                    continue;
                };
                sooner_behind(&ctx, (db, name.clone()), seq, amount);
            }
        }
    });
}

/// The timed waiters of `name` that arrived after `seq` come sooner by `amount` (what
/// a give-back or a refund returned to the key).
fn sooner_behind(ctx: &Ctx, name: KeyName, seq: u64, amount: f64) {
    let behind: Vec<u64> = with(|r| {
        r.queues
            .get(&name)
            .map(|queue| queue.iter().copied().filter(|&other| other > seq).collect())
            .unwrap_or_default()
    });
    let now = clock();
    for other in behind {
        let moved = with(|r| {
            let waiter = r.waiters.get_mut(&other)?;
            let index = waiter.held.keys().iter().position(|key| *key == name.1)?;
            let at = waiter.held.sooner(index, amount).filter(|_| waiter.timed)?;
            Some((waiter.timer, at))
        });
        if let Some((timer, at)) = moved {
            stop_timer(ctx, timer);
            let timer = start_timer(ctx, at - now, on_due, other);
            with(|r| {
                if let Some(waiter) = r.waiters.get_mut(&other) {
                    waiter.timer = timer;
                }
            });
        }
    }
}

/// Something was given back to `key` (the calling client's database) outside its
/// waiters (QAG.REFUND): every timed waiter there comes sooner by `amount`.
pub fn given_back_to(ctx: &Ctx, key: &[u8], amount: f64) {
    if amount > 0.0 {
        sooner_behind(ctx, (selected_db(ctx), key.to_vec()), 0, amount);
    }
}
