//! Waiters (`WAIT ms`): callers the module keeps blocked until their call fits, then
//! answers, as BLPOP answers when a list fills. Each family's waiting call is a [`Held`]:
//! a timed one (a token bucket's, a throttle's: charged when it arrives, answered at the
//! time its tokens exist) is answered by a timer at that time; a slot waiter (a lease's)
//! is answered by a timer a moment after an event frees a slot (a release, a lease
//! running out, any change to its key, a flush or a database swap), and refused by a
//! timer when its wait runs out. Waiters are answered only in timers, never inside a
//! command (`serve_slots` says why). Waiters of one key are kept in arrival order: a timed one is served in that
//! order by construction (each charged the key before the next), slot waiters are given
//! slots in that order.
//!
//! Each waiter's life is decided by `qag_core::waiter::step` (whichever of its ends
//! comes first wins, every later one is a no-op); this file performs the steps. A waiter
//! that is not answered allowed (its client gone, CLIENT UNBLOCK, or its answer never
//! written) gives back what it was charged, in a timer a moment later (never inside the
//! server's handling of the client's end, nor of an event), and the timed waiters behind
//! it on its keys come that much sooner. A charge its request id's replays wait on is
//! given back only once they are all gone unanswered (`qag_core::waiter::Shares`).
//!
//! Writes happen in commands and in timers, and a timer writes only where a command
//! could: never on a replica (a primary turned replica drops what it would have given
//! back: the new primary has the charge, which stands), and never while the server
//! pauses writes (CLIENT PAUSE … WRITE, FAILOVER, a cluster's manual failover): then the
//! timer looks again a moment later. Everything here runs on the server's main thread.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicI64, Ordering};

use qag_core::wait::{millis_up, DEFAULT_MAX_WAITERS};
use qag_core::waiter::{self, Charge, Event, Settled, Shares, Stage, Unblock};
use redis_module::raw;

use crate::command::{guarded, Reply};
use crate::key::OwnedString;
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
    /// Gives back what it holds, its answer never written: per key (an index into
    /// `keys`), what the waiters behind it there are given (`Held::sooner`'s amount).
    fn give_back(&mut self, ctx: &Ctx, now_micros: i64) -> Vec<(usize, f64)>;
    /// Waiters ahead of it on its key `key` gave back `amount` (tokens, or a throttle's
    /// nanoseconds): its new time, Unix microseconds, if that moved it.
    fn sooner(&mut self, key: usize, amount: f64) -> Option<i64>;
}

/// A waiting call's request id, by the field that remembers it in its first key.
pub enum Request {
    /// The call charged for the request.
    Charged(Vec<u8>),
    /// A replay of it, charged nothing, waiting for the first call's time.
    Replay(Vec<u8>),
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
    /// When it arrived, by the monotonic clock: how long it waited.
    arrived_monotonic: i64,
    /// Its timer while it waits: a timed waiter's time, or a slot waiter's end of wait;
    /// and when that is by the monotonic clock (a timer follows the wall clock).
    timer: raw::RedisModuleTimerID,
    deadline_monotonic: i64,
    timed: bool,
    stage: Stage,
    /// What it holds; taken while a family serves it, and when it is given back.
    held: Option<Box<dyn Held>>,
    /// Its answer once given, until written.
    answer: Option<Reply>,
    /// The request charge it waits on, and whether it is the call that was charged.
    share: Option<(u64, bool)>,
}

/// A request: its database, its first key and its id's field there.
type RequestName = (c_int, Vec<u8>, Vec<u8>);

/// A charge to give back: whose (its database and arrival number) and what gives it.
struct Refund {
    db: c_int,
    seq: u64,
    held: Box<dyn Held>,
}

/// A give-back waiting for its timer.
enum GiveBack {
    Own(Refund),
    /// A request's charge, once no replay waits on it (`Shares::give_back`).
    Shared(u64),
}

type KeyName = (c_int, Vec<u8>);

#[derive(Default)]
struct Registry {
    /// Arrival order: every waiter's number is above those of the waiters before it.
    next_seq: u64,
    /// Every waiter from the moment it blocks until it ends.
    waiters: HashMap<u64, Waiter>,
    /// Waiters by their handle, until the server frees it.
    by_client: HashMap<usize, u64>,
    /// Each key's waiting waiters, in arrival order.
    queues: HashMap<KeyName, VecDeque<u64>>,
    /// Keys whose slot waiters are to be looked at, by the timer that will and when
    /// (Unix microseconds).
    checks: HashMap<KeyName, (raw::RedisModuleTimerID, i64)>,
    /// Give-backs the next `on_give_backs` makes, and its timer while one is set.
    give_backs: Vec<GiveBack>,
    give_back_timer: Option<raw::RedisModuleTimerID>,
    shares: Shares<RequestName, Refund>,
    /// The server's wall clock less the monotonic one at the last cron run: a step back
    /// of the wall clock shows as a fall.
    clock_offset: Option<i64>,
    /// Whether the module is subscribed to the keyspace events that free a slot: only
    /// while slot waiters may be waiting, since every subscribed event on any key costs
    /// the server a context of its own (about 600 instructions).
    watching: bool,
}

thread_local! {
    static REGISTRY: RefCell<Registry> = RefCell::new(Registry::default());
}

/// The registry, never across a call into the server that may call back into this file
/// (a write's keyspace event): the families serve and give back outside it.
fn with<T>(f: impl FnOnce(&mut Registry) -> T) -> T {
    REGISTRY.with(|registry| f(&mut registry.borrow_mut()))
}

/// The clients the module holds blocked (INFO's `qag_waiters`): waiting, or answered and
/// not yet released by the server. None when the registry is in use (a crash report).
pub fn blocked() -> Option<u64> {
    REGISTRY.with(|registry| registry.try_borrow().ok().map(|r| r.waiters.len() as u64))
}

/// Whether a call may wait here now: a client that can be blocked, and room for it.
/// Asked only of a call that must wait to be allowed.
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

/// How many slot waiters wait on `key` (the calling client's database): the free slots
/// they are owed before a newcomer.
pub fn slot_waiters(ctx: &Ctx, key: &[u8]) -> usize {
    with(|r| {
        if r.queues.is_empty() {
            return 0;
        }
        let Some(queue) = r.queues.get(&(selected_db(ctx), key.to_vec())) else {
            return 0;
        };
        queue
            .iter()
            .filter(|seq| {
                r.waiters
                    .get(seq)
                    .is_some_and(|w| !w.timed && w.stage == Stage::Waiting)
            })
            .count()
    })
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
pub fn hold(
    ctx: &Ctx,
    held: Box<dyn Held>,
    due_micros: i64,
    timed: bool,
    request: Option<Request>,
) -> Reply {
    let now = ctx.now_micros();
    let arrived_monotonic = monotonic();
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
        let first = held.keys().first().cloned().unwrap_or_default();
        let share = match request {
            Some(Request::Charged(field)) => {
                r.shares.charge(seq, (db, first, field));
                Some((seq, true))
            }
            Some(Request::Replay(field)) => {
                r.shares.join(&(db, first, field)).map(|id| (id, false))
            }
            None => None,
        };
        let timer = start_timer(ctx, due_micros - now, on_due, seq);
        r.by_client.insert(client as usize, seq);
        r.waiters.insert(
            seq,
            Waiter {
                client,
                db,
                arrived_monotonic,
                timer,
                deadline_monotonic: arrived_monotonic + (due_micros - now).max(0),
                timed,
                stage: Stage::Waiting,
                held: Some(held),
                answer: None,
                share,
            },
        );
    });
    WAITS.started();
    Reply::Held
}

/// A replay of the request remembered in `field` of `key` (the calling client's
/// database) was answered allowed at once: the charge it replays stands.
pub fn replay_answered(ctx: &Ctx, key: &[u8], field: Vec<u8>) {
    let request = (selected_db(ctx), key.to_vec(), field);
    with(|r| r.shares.stand(&request));
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

/// No timer: a waiter's whose timer is firing now.
const NO_TIMER: raw::RedisModuleTimerID = 0;

/// Stops a timer, never one whose callback runs now: the server frees a timer after its
/// callback returns, and would free one stopped inside it twice.
fn stop_timer(ctx: &Ctx, timer: raw::RedisModuleTimerID) {
    if timer == NO_TIMER {
        return;
    }
    // SAFETY: a live context; a timer that fired already is simply not found.
    unsafe { raw::RedisModule_StopTimer.unwrap()(ctx.raw(), timer, std::ptr::null_mut()) };
}

/// Takes waiter `seq` out of its keys' queues: it waits no more. The timers of keys
/// left with no waiter, to stop (their names boxed: `stop_checks`), so that no timer
/// outlives every waiter (MODULE UNLOAD refuses a module with timers).
fn dequeue(r: &mut Registry, seq: u64) -> Vec<raw::RedisModuleTimerID> {
    let mut idle = Vec::new();
    let Some(waiter) = r.waiters.get(&seq) else {
        return idle;
    };
    let db = waiter.db;
    let keys: Vec<Vec<u8>> = waiter
        .held
        .as_ref()
        .map(|held| held.keys().to_vec())
        .unwrap_or_default();
    for key in keys {
        let name = (db, key);
        if let Some(queue) = r.queues.get_mut(&name) {
            queue.retain(|&other| other != seq);
            if queue.is_empty() {
                r.queues.remove(&name);
                idle.extend(r.checks.remove(&name).map(|(timer, _)| timer));
            }
        }
    }
    idle
}

/// Stops the look-again timers of keys no waiter waits on.
fn stop_checks(ctx: &Ctx, timers: Vec<raw::RedisModuleTimerID>) {
    for timer in timers {
        let mut data = std::ptr::null_mut();
        // SAFETY: a timer check_at made, its key's name boxed: taken back here.
        unsafe { raw::RedisModule_StopTimer.unwrap()(ctx.raw(), timer, &mut data) };
        if !data.is_null() {
            drop(unsafe { Box::from_raw(data.cast::<KeyName>()) });
        }
    }
}

/// What a waiter's charge comes to: given back now (its own), given back once no replay
/// waits on it (a request's), or kept.
fn settle(r: &mut Registry, seq: u64, charge: Charge) -> Option<GiveBack> {
    let waiter = r.waiters.get_mut(&seq)?;
    let db = waiter.db;
    match (waiter.share, charge) {
        (Some((id, charged)), _) => {
            let refund = match (charged, charge) {
                (true, Charge::Released) => waiter.held.take().map(|held| Refund { db, seq, held }),
                _ => None,
            };
            match r.shares.end(id, charge, refund) {
                Settled::GiveBack(id) => Some(GiveBack::Shared(id)),
                Settled::Nothing => None,
            }
        }
        (None, Charge::Released) => waiter
            .held
            .take()
            .map(|held| GiveBack::Own(Refund { db, seq, held })),
        (None, Charge::Stands) => None,
    }
}

/// Runs `event` on waiter `seq` (found by its number or its client), performing its
/// step. `answer`: the answer a serve or refusal gives it; `ctx`: the callback's.
fn on_event(ctx: &Ctx, seq: u64, event: Event, answer: Option<Reply>) {
    let Some((before, client, timer)) = with(|r| {
        r.waiters
            .get(&seq)
            .map(|waiter| (waiter.stage, waiter.client, waiter.timer))
    }) else {
        return;
    };
    let step = waiter::step(before, event);
    if step.is_no_op(before) {
        return;
    }
    if step.stop_waiting {
        stop_timer(ctx, timer);
        let idle = with(|r| dequeue(r, seq));
        stop_checks(ctx, idle);
    }
    if step.refuse_here {
        // The timeout callback's context replies to its client; the family reads its
        // key outside the registry.
        let held = with(|r| r.waiters.get_mut(&seq).and_then(|w| w.held.take()));
        if let Some(held) = held {
            let now = clock();
            let waited = waited_ms(seq);
            ctx.reply(held.refusal(ctx, now, waited));
            with(|r| {
                if let Some(waiter) = r.waiters.get_mut(&seq) {
                    waiter.held = Some(held);
                }
            });
        }
    }
    if step.write_answer {
        if let Some(reply) = with(|r| r.waiters.get_mut(&seq).and_then(|w| w.answer.take())) {
            ctx.reply(reply);
        }
    }
    let give_back = with(|r| {
        if let Some(waiter) = r.waiters.get_mut(&seq) {
            waiter.stage = step.stage;
            if step.unblock == Some(Unblock::WithAnswer) {
                waiter.answer = answer;
            }
        }
        step.charge.and_then(|charge| settle(r, seq, charge))
    });
    match (event, step.charge) {
        (Event::Disconnected | Event::Unblocked, _) => WAITS.given_back(),
        (Event::Free, Some(Charge::Released)) => WAITS.given_back(),
        _ => {}
    }
    if let Some(give_back) = give_back {
        give_back_later(ctx, give_back);
    }
    // The server frees the handle after a bare unblock and after the free callback:
    // another client blocked later may get its address.
    let handle_freed = step.unblock == Some(Unblock::Bare) || event == Event::Free;
    with(|r| {
        if handle_freed && r.by_client.get(&(client as usize)) == Some(&seq) {
            r.by_client.remove(&(client as usize));
        }
        if step.stage == Stage::Ended {
            r.waiters.remove(&seq);
        }
    });
    match step.unblock {
        // SAFETY: a client this module blocked and never unblocked (the step says so);
        // its answer is the waiter's number, never dereferenced, freed by on_free.
        Some(Unblock::WithAnswer) => unsafe {
            raw::RedisModule_UnblockClient.unwrap()(client, seq as usize as *mut c_void);
        },
        // SAFETY: as above, with no answer: the server frees the handle, no callback.
        Some(Unblock::Bare) => unsafe {
            raw::RedisModule_UnblockClient.unwrap()(client, std::ptr::null_mut());
        },
        None => {}
    }
}

/// How long waiter `seq` waited, in whole milliseconds: by the monotonic clock, so that a
/// step of the wall clock does not change it.
fn waited_ms(seq: u64) -> i64 {
    let now = monotonic();
    let arrived = with(|r| r.waiters.get(&seq).map_or(now, |w| w.arrived_monotonic));
    (now - arrived).max(0) / 1000
}

/// Serves a timed waiter now (its time came), or refuses a slot waiter (its wait ran
/// out).
fn serve_or_refuse(ctx: &Ctx, seq: u64) {
    let Some((db, timed, mut held)) = with(|r| {
        let waiter = r.waiters.get_mut(&seq)?;
        if waiter.stage != Stage::Waiting {
            return None;
        }
        // Its timer is the one firing.
        waiter.timer = NO_TIMER;
        Some((waiter.db, waiter.timed, waiter.held.take()?))
    }) else {
        return;
    };
    let now = clock();
    let waited = waited_ms(seq);
    select_db(ctx, db);
    let served = match timed {
        true => match held.serve(ctx, now, waited) {
            Serve::Now(reply) => Some(reply),
            Serve::Later(_) => None,
        },
        false => None,
    };
    let (event, reply) = match served {
        Some(reply) => {
            WAITS.served(waited);
            (Event::Served, reply)
        }
        None => {
            WAITS.timed_out();
            (Event::Refused, held.refusal(ctx, now, waited))
        }
    };
    put_back(seq, held);
    on_event(ctx, seq, event, Some(reply));
}

fn put_back(seq: u64, held: Box<dyn Held>) {
    with(|r| {
        if let Some(waiter) = r.waiters.get_mut(&seq) {
            waiter.held = Some(held);
        }
    });
}

fn select_db(ctx: &Ctx, db: c_int) {
    // SAFETY: a live context; a database the waiter's client had selected.
    unsafe { raw::RedisModule_SelectDb.unwrap()(ctx.raw(), db) };
}

/// Gives slots to the slot waiters of `key` (the calling client's database), first come
/// first served, while they fit, at `now` (Unix microseconds); then looks again when a
/// lease is due to run out. Only in a timer (one that checked writes are allowed),
/// never inside a command: a client answered inside a command can meet a CLIENT
/// UNBLOCK or a kill later in the same turn (in one pipeline or one MULTI), which the
/// server handles wrongly for a client a module unblocked (Redis 7.0 leaves it no
/// reply, 7.2.0 to 7.2.6 fail an assertion). A timer runs after the turn's commands,
/// and the server answers what it unblocked before it reads another command.
fn serve_slots(ctx: &Ctx, key: &[u8], now: i64) {
    let db = selected_db(ctx);
    let name = (db, key.to_vec());
    loop {
        let Some((seq, mut held)) = with(|r| {
            let seq = slot_waiter_first(r, &name)?;
            let waiter = r.waiters.get_mut(&seq)?;
            Some((seq, waiter.held.take()?))
        }) else {
            return;
        };
        let waited = waited_ms(seq);
        // Outside the registry: a write fires keyspace events that look at it.
        let served = held.serve(ctx, now, waited);
        put_back(seq, held);
        match served {
            Serve::Now(reply) => {
                WAITS.served(waited);
                on_event(ctx, seq, Event::Served, Some(reply));
            }
            Serve::Later(look_again) => {
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
        .filter(|waiter| !waiter.timed && waiter.stage == Stage::Waiting)
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
        stop_checks(ctx, vec![stale]);
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

/// A database flushed or two swapped (server events): keys change without a keyspace
/// event of their own, so the slot waiters of every key there are looked at a moment
/// later, outside the event.
extern "C" fn on_databases_changed(
    ctx: *mut raw::RedisModuleCtx,
    event: raw::RedisModuleEvent,
    subevent: u64,
    data: *mut c_void,
) {
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        let databases: Option<[c_int; 2]> = match event.id {
            raw::REDISMODULE_EVENT_FLUSHDB if subevent == raw::REDISMODULE_SUBEVENT_FLUSHDB_END => {
                // SAFETY: the flush event's data, live for the callback.
                let info = unsafe { &*data.cast::<raw::RedisModuleFlushInfo>() };
                Some([info.dbnum, info.dbnum])
            }
            raw::REDISMODULE_EVENT_SWAPDB => {
                // SAFETY: the swap event's data, live for the callback.
                let info = unsafe { &*data.cast::<raw::RedisModuleSwapDbInfo>() };
                Some([info.dbnum_first, info.dbnum_second])
            }
            _ => None,
        };
        let Some(databases) = databases else {
            return;
        };
        // -1: every database (FLUSHALL).
        let changed = |db: c_int| databases.contains(&-1) || databases.contains(&db);
        let names: Vec<KeyName> = with(|r| {
            r.queues
                .keys()
                .filter(|name| changed(name.0) && slot_waiter_first(r, name).is_some())
                .cloned()
                .collect()
        });
        for name in names {
            check_at(&ctx, name, 0);
        }
    });
}

/// Subscribes to the server events that change keys without a keyspace event of their
/// own; called at load. Both are rare (FLUSHDB, FLUSHALL, SWAPDB), so the subscription
/// costs nothing on any call.
pub fn subscribe_to_server_events(ctx: *mut raw::RedisModuleCtx) {
    let events = [
        raw::REDISMODULE_EVENT_FLUSHDB,
        raw::REDISMODULE_EVENT_SWAPDB,
    ];
    for id in events {
        let event = raw::RedisModuleEvent { id, dataver: 1 };
        // SAFETY: checked present at load; a live load context.
        unsafe {
            raw::RedisModule_SubscribeToServerEvent.unwrap()(ctx, event, Some(on_databases_changed))
        };
    }
}

/// The events that may free a slot: a member removed, a key deleted, expired or evicted.
const SLOT_EVENTS: c_int = (raw::REDISMODULE_NOTIFY_ZSET
    | raw::REDISMODULE_NOTIFY_GENERIC
    | raw::REDISMODULE_NOTIFY_EXPIRED
    | raw::REDISMODULE_NOTIFY_EVICTED) as c_int;

/// How often, while subscribed, the module looks whether any slot waiter is left.
const QUIET_CHECK_MS: i64 = 1000;

/// How soon a timer that may not write now (writes paused) looks again.
const PAUSED_RETRY_MICROS: i64 = 10_000;

/// How soon a key's slot waiters are looked at again while the cluster is down.
const CLUSTER_DOWN_RETRY_MICROS: i64 = 100_000;

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

/// Whether a timer may write now: not while the server pauses writes (the server
/// asserts that nothing propagates then, and a paused expiry leaves keys a write would
/// trip over), and not on a replica (`Writable::Never`).
#[derive(PartialEq, Eq)]
enum Writable {
    Now,
    Later,
    Never,
}

fn writable(ctx: &Ctx) -> Writable {
    // SAFETY: a live context; AvoidReplicaTraffic checked present at load.
    let flags = unsafe { raw::RedisModule_GetContextFlags.unwrap()(ctx.raw()) } as u32;
    if flags & raw::REDISMODULE_CTX_FLAGS_SLAVE != 0 {
        return Writable::Never;
    }
    match unsafe { raw::RedisModule_AvoidReplicaTraffic.unwrap()() } {
        0 => Writable::Now,
        _ => Writable::Later,
    }
}

extern "C" fn on_check(ctx: *mut raw::RedisModuleCtx, data: *mut c_void) {
    // SAFETY: the name check_at boxed for this timer, taken back once.
    let name = unsafe { Box::from_raw(data.cast::<KeyName>()) };
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        with(|r| r.checks.remove(&*name));
        match writable(&ctx) {
            // Serving a slot writes its lease: a moment later.
            Writable::Later => check_at(&ctx, *name, PAUSED_RETRY_MICROS),
            // A replica's waiters were unblocked when it became one; none is served.
            Writable::Never => {}
            Writable::Now => {
                select_db(&ctx, name.0);
                match served_here(&ctx, &name.1) {
                    Served::Here => serve_slots(&ctx, &name.1, clock()),
                    Served::Elsewhere => send_elsewhere(&ctx, &name),
                    Served::Down => check_at(&ctx, *name, CLUSTER_DOWN_RETRY_MICROS),
                }
            }
        }
    });
}

/// The answer of a slot waiter whose key this node no longer serves: cluster clients
/// send a call answered TRYAGAIN again, and find the key's node.
const TRY_AGAIN: &str =
    "TRYAGAIN the key's slot moved to another node while the call waited; send it again";

/// Where `key` (the context's database) is served now.
enum Served {
    Here,
    /// In a cluster, on another node: its slot is served there, or is being migrated
    /// there and the key is gone from here (MIGRATE's deletion wakes its waiters).
    Elsewhere,
    /// Nowhere: the cluster is down; looked at again a moment later.
    Down,
}

/// Where `key` is served: the server's own routing check, as it makes it for RM_Call
/// (`EPERM`: another node's; `ENETDOWN`, `EROFS`: the cluster is down). A timer's
/// question only, never a command's: a command was routed already.
fn served_here(ctx: &Ctx, key: &[u8]) -> Served {
    // SAFETY: a live context.
    let flags = unsafe { raw::RedisModule_GetContextFlags.unwrap()(ctx.raw()) } as u32;
    if flags & raw::REDISMODULE_CTX_FLAGS_CLUSTER == 0 {
        return Served::Here;
    }
    let name = OwnedString::new(ctx, key);
    // SAFETY: checked present at load; a live context and string; the reply freed here.
    let reply = unsafe {
        raw::RedisModule_Call.unwrap()(ctx.raw(), c"EXISTS".as_ptr(), c"s".as_ptr(), name.raw)
    };
    if !reply.is_null() {
        // SAFETY: a reply RM_Call made, freed once.
        unsafe { raw::RedisModule_FreeCallReply.unwrap()(reply) };
        return Served::Here;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EPERM) => Served::Elsewhere,
        Some(libc::ENETDOWN | libc::EROFS) => Served::Down,
        // Anything else is no question of routing.
        _ => Served::Here,
    }
}

/// Answers every slot waiter of `name` TRYAGAIN: its key is served elsewhere now.
fn send_elsewhere(ctx: &Ctx, name: &KeyName) {
    while let Some(seq) = with(|r| slot_waiter_first(r, name)) {
        WAITS.moved();
        on_event(ctx, seq, Event::Refused, Some(Reply::Error(TRY_AGAIN)));
    }
}

extern "C" fn on_due(ctx: *mut raw::RedisModuleCtx, data: *mut c_void) {
    let _ = guarded(|| serve_or_refuse(&Ctx(ctx), data as usize as u64));
}

/// The waiter an answer's data names: its number, given to RM_UnblockClient.
fn answered(ctx: &Ctx) -> Option<u64> {
    // SAFETY: a blocked-reply context: the data this module gave RM_UnblockClient.
    let data = unsafe { raw::RedisModule_GetBlockedClientPrivateData.unwrap()(ctx.raw()) };
    (!data.is_null()).then_some(data as usize as u64)
}

/// The reply callback: a served (or refused) waiter's answer, written.
extern "C" fn on_reply(
    ctx: *mut raw::RedisModuleCtx,
    _argv: *mut *mut raw::RedisModuleString,
    _argc: c_int,
) -> c_int {
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        if let Some(seq) = answered(&ctx) {
            on_event(&ctx, seq, Event::Reply, None);
        }
    });
    raw::REDISMODULE_OK as c_int
}

/// The free callback: an answer freed, written or not (its client gone first).
extern "C" fn on_free(ctx: *mut raw::RedisModuleCtx, data: *mut c_void) {
    let _ = guarded(|| on_event(&Ctx(ctx), data as usize as u64, Event::Free, None));
}

/// The timeout callback: CLIENT UNBLOCK on a waiter.
extern "C" fn on_unblocked(
    ctx: *mut raw::RedisModuleCtx,
    _argv: *mut *mut raw::RedisModuleString,
    _argc: c_int,
) -> c_int {
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        // SAFETY: the timeout callback's context holds its blocked client.
        let client = unsafe { raw::RedisModule_GetBlockedClientHandle.unwrap()(ctx.raw()) };
        if let Some(seq) = with(|r| r.by_client.get(&(client as usize)).copied()) {
            on_event(&ctx, seq, Event::Unblocked, None);
        }
    });
    raw::REDISMODULE_OK as c_int
}

/// The disconnect callback: a waiter's client is going (or, given its answer, was
/// unblocked by the server).
extern "C" fn on_disconnect(
    ctx: *mut raw::RedisModuleCtx,
    client: *mut raw::RedisModuleBlockedClient,
) {
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        if let Some(seq) = with(|r| r.by_client.get(&(client as usize)).copied()) {
            on_event(&ctx, seq, Event::Disconnected, None);
        }
    });
}

/// Queues a give-back for the next turn of the event loop (`ctx`: any context of the
/// module's, a timer needs no more).
fn give_back_later(ctx: &Ctx, give_back: GiveBack) {
    let start = with(|r| {
        r.give_backs.push(give_back);
        r.give_back_timer.is_none()
    });
    if start {
        give_backs_in(ctx, 0);
    }
}

/// Sets the give-backs' one timer.
fn give_backs_in(ctx: &Ctx, in_micros: i64) {
    let timer = start_timer(ctx, in_micros, on_give_backs, 0);
    with(|r| r.give_back_timer = Some(timer));
}

/// The wall clock, Unix microseconds: outside a command, the server's cached time may be
/// as old as its last command or cron run.
fn clock() -> i64 {
    read_clock(libc::CLOCK_REALTIME)
}

/// The monotonic clock, microseconds: what bounds a wait, whatever the wall clock does.
fn monotonic() -> i64 {
    read_clock(libc::CLOCK_MONOTONIC)
}

fn read_clock(which: libc::clockid_t) -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(which, &mut ts) };
    ts.tv_sec * 1_000_000 + ts.tv_nsec / 1000
}

/// How far the wall clock may fall behind the monotonic one between two cron runs
/// before it counts as stepped back (slewing moves it by microseconds a second; the
/// server's clock is read to the millisecond).
const CLOCK_STEP_MICROS: i64 = 50_000;

/// Subscribes to the server's cron (`hz` times a second, on its monotonic clock); called
/// at load. Each run reads two clocks.
pub fn watch_the_clock(ctx: *mut raw::RedisModuleCtx) {
    let event = raw::RedisModuleEvent {
        id: raw::REDISMODULE_EVENT_CRON_LOOP,
        dataver: 1,
    };
    // SAFETY: checked present at load; a live load context.
    unsafe { raw::RedisModule_SubscribeToServerEvent.unwrap()(ctx, event, Some(on_cron)) };
}

/// A cron run: where the wall clock stepped back since the last, every waiter's timer
/// is set again by the monotonic clock. A module timer follows the wall clock, so a
/// step back of a minute would hold each waiter a minute beyond its wait (and beyond
/// the 60 s any wait may last); a step forward fires timers early, and the families'
/// arithmetic, which reads the wall clock, sees that much time gone too.
extern "C" fn on_cron(
    ctx: *mut raw::RedisModuleCtx,
    _event: raw::RedisModuleEvent,
    _subevent: u64,
    _data: *mut c_void,
) {
    let _ = guarded(|| {
        // The server's own wall clock: the one its module timers follow.
        // SAFETY: checked present at load.
        let wall = unsafe { raw::RedisModule_Milliseconds.unwrap()() } * 1000;
        let offset = wall - monotonic();
        let Some(last) = with(|r| r.clock_offset.replace(offset)) else {
            return;
        };
        if last - offset > CLOCK_STEP_MICROS {
            set_timers_again(&Ctx(ctx), last - offset);
        }
    });
}

/// After the wall clock stepped back by `step`: each waiter's timer set to its monotonic
/// deadline, the keys' looks that were due by then made now, the give-backs made now.
fn set_timers_again(ctx: &Ctx, step: i64) {
    let now_monotonic = monotonic();
    let waiting: Vec<(u64, raw::RedisModuleTimerID, i64)> = with(|r| {
        r.waiters
            .iter()
            .filter(|(_, w)| w.stage == Stage::Waiting && w.timer != NO_TIMER)
            .map(|(&seq, w)| (seq, w.timer, w.deadline_monotonic))
            .collect()
    });
    for (seq, timer, deadline) in waiting {
        stop_timer(ctx, timer);
        let timer = start_timer(ctx, deadline - now_monotonic, on_due, seq);
        with(|r| {
            if let Some(waiter) = r.waiters.get_mut(&seq) {
                waiter.timer = timer;
            }
        });
    }
    // A lease's expiry is on the wall clock: a look at it stays there, unless it was
    // due by the time the clock stepped.
    let now = clock();
    let due: Vec<KeyName> = with(|r| {
        r.checks
            .iter()
            .filter(|(_, &(_, at))| at <= now + step)
            .map(|(name, _)| name.clone())
            .collect()
    });
    for name in due {
        check_at(ctx, name, 0);
    }
    if let Some(timer) = with(|r| r.give_back_timer) {
        stop_timer(ctx, timer);
        give_backs_in(ctx, 0);
    }
}

extern "C" fn on_give_backs(ctx: *mut raw::RedisModuleCtx, _data: *mut c_void) {
    let _ = guarded(|| {
        let ctx = Ctx(ctx);
        let writable = writable(&ctx);
        if writable == Writable::Later {
            give_backs_in(&ctx, PAUSED_RETRY_MICROS);
            return;
        }
        let refunds: Vec<Refund> = with(|r| {
            r.give_back_timer = None;
            let give_backs = std::mem::take(&mut r.give_backs);
            give_backs
                .into_iter()
                .filter_map(|give_back| match give_back {
                    GiveBack::Own(refund) => Some(refund),
                    GiveBack::Shared(id) => r.shares.give_back(id),
                })
                .collect()
        });
        if writable == Writable::Never {
            // A primary turned replica: the new primary has the charge, which stands.
            WAITS.dropped(refunds.len() as u64);
            return;
        }
        let mut given: HashMap<KeyName, Vec<(u64, f64)>> = HashMap::new();
        for Refund { db, seq, mut held } in refunds {
            select_db(&ctx, db);
            for (key, amount) in held.give_back(&ctx, clock()) {
                if let Some(name) = held.keys().get(key) {
                    given
                        .entry((db, name.clone()))
                        .or_default()
                        .push((seq, amount));
                }
            }
        }
        for (name, amounts) in given {
            sooner_behind(&ctx, name, &amounts);
        }
    });
}

/// The timed waiters of `name` come sooner by what was given back ahead of each
/// (`amounts`: who gave back, and how much), each timer moved once.
fn sooner_behind(ctx: &Ctx, name: KeyName, amounts: &[(u64, f64)]) {
    let queue: Vec<u64> = with(|r| {
        r.queues
            .get(&name)
            .map(|queue| queue.iter().copied().collect())
            .unwrap_or_default()
    });
    let now = clock();
    for (other, amount) in waiter::sooner_by(&queue, amounts) {
        let moved = with(|r| {
            let waiter = r.waiters.get_mut(&other)?;
            let held = waiter.held.as_mut()?;
            let index = held.keys().iter().position(|key| *key == name.1)?;
            let at = held.sooner(index, amount).filter(|_| waiter.timed)?;
            Some((waiter.timer, at))
        });
        if let Some((timer, at)) = moved {
            stop_timer(ctx, timer);
            let timer = start_timer(ctx, at - now, on_due, other);
            let deadline = monotonic() + (at - now).max(0);
            with(|r| {
                if let Some(waiter) = r.waiters.get_mut(&other) {
                    waiter.timer = timer;
                    waiter.deadline_monotonic = deadline;
                }
            });
        }
    }
}

/// Something was given back to `key` (the calling client's database) outside its
/// waiters (QAG.REFUND): every timed waiter there comes sooner by `amount`.
pub fn given_back_to(ctx: &Ctx, key: &[u8], amount: f64) {
    if amount > 0.0 {
        sooner_behind(ctx, (selected_db(ctx), key.to_vec()), &[(0, amount)]);
    }
}
