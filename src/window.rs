//! The sliding-window family: QAG.ADMIT and QAG.RECORD, requests and tokens per window
//! across a chain of scopes, each a hash with fields `req:<n>` and `tok:<n>` for window
//! number n.

use std::cell::RefCell;
use std::ffi::CStr;
use std::ptr;

use qag_core::number::stored_count;
use qag_core::window::{self, Clock, Counters, FieldName, Hold, Holds, Kind};

use qag_core::args::ArgList;
use qag_core::replay::{self as replay_core, IdArg, Reserved};
use redis_module::raw;

use crate::command::{Arg, Command, KeyLayout, RawArgs, Reply, ID_ARG};
use crate::key::{Access, FieldName as SharedName, Key, OwnedString, ValueType};
use crate::replay::{self, Remembered, RequestId, Reservation};
use crate::server::RawString;
use crate::server::{CommandError, Ctx};
use crate::stats::CallCounters;

static HOLDS: SharedName = SharedName::new(window::HOLDS_FIELD);

/// Makes the field name; called once when the module loads.
pub fn init() {
    HOLDS.create();
}

/// The call's clock and the field names it reads and writes: the current and previous
/// windows'. The same for every scope, so made once per call.
struct Fields {
    clock: Clock,
    /// The latest a stored hold may end (`Clock::trusted_until`).
    trusted_until: i64,
    requests: RawString,
    previous_requests: RawString,
    tokens: RawString,
    previous_tokens: RawString,
}

/// The four field names of the window made last, kept from call to call: they change
/// once a window, and making them is four server strings a call.
struct WindowNames {
    window: i64,
    /// req:n, req:n-1, tok:n, tok:n-1; strings of no context, freed when replaced.
    names: [RawString; 4],
}

thread_local! {
    // Commands run on the server's main thread only.
    static NAMES: RefCell<Option<WindowNames>> = const { RefCell::new(None) };
}

impl Fields {
    fn new(clock: Clock) -> Fields {
        let n = clock.window();
        let [requests, previous_requests, tokens, previous_tokens] =
            NAMES.with_borrow_mut(|kept| {
                if let Some(kept) = kept.as_ref().filter(|kept| kept.window == n) {
                    return kept.names;
                }
                let name = |kind, window| {
                    let text = FieldName::new(kind, window);
                    // SAFETY: a buffer of the given length; a NULL context makes a string
                    // that lives until freed.
                    unsafe {
                        raw::RedisModule_CreateString.unwrap()(
                            ptr::null_mut(),
                            text.as_bytes().as_ptr().cast(),
                            text.as_bytes().len(),
                        )
                    }
                };
                let names = [
                    name(Kind::Requests, n),
                    name(Kind::Requests, n - 1),
                    name(Kind::Tokens, n),
                    name(Kind::Tokens, n - 1),
                ];
                if let Some(old) = kept.replace(WindowNames { window: n, names }) {
                    for name in old.names {
                        // SAFETY: made above with no context, used by no call now running
                        // (the server holds its own references to what it keeps).
                        unsafe { raw::RedisModule_FreeString.unwrap()(ptr::null_mut(), name) };
                    }
                }
                names
            });
        Fields {
            clock,
            trusted_until: clock.trusted_until(),
            requests,
            previous_requests,
            tokens,
            previous_tokens,
        }
    }
}

/// Every scope of a call: its key, opened for writing, and what it holds. All keys are
/// opened, and their types checked, before any is written.
struct Chain<'ctx> {
    keys: Vec<Key<'ctx>>,
    scopes: Vec<Scope>,
    fields: Fields,
}

impl<'ctx> Chain<'ctx> {
    /// Opens and reads the scopes of `keys`, and the call's request id, `id` (its
    /// command and argument), from the first with its other fields.
    fn open(
        ctx: &'ctx Ctx,
        args: &RawArgs,
        keys: impl Iterator<Item = usize>,
        window_seconds: i64,
        id: Option<(&str, IdArg)>,
    ) -> Result<(Chain<'ctx>, Option<RequestId>), CommandError> {
        let clock = Clock::new(window_seconds, ctx.now_micros());
        let keys = keys
            .map(|index| Key::open(ctx, args.string(index), Access::ReadWrite, ValueType::Hash))
            .collect::<Result<Vec<_>, _>>()?;
        let fields = Fields::new(clock);
        let id_field = id.map(|(command, id)| (RequestId::field(ctx, command, args, id.index), id));
        let mut id_value = None;
        let scopes = keys
            .iter()
            .enumerate()
            .map(|(i, key)| {
                let id = id_field.as_ref().filter(|_| i == 0);
                Scope::read(
                    key,
                    &fields,
                    id.map(|(field, _)| (field.raw, &mut id_value)),
                )
            })
            .collect::<Vec<Scope>>();
        let now = clock.now_micros / 1000;
        let id = id_field.map(|(field, id)| RequestId::found(field, id_value, id, now));
        let chain = Chain {
            keys,
            scopes,
            fields,
        };
        Ok((chain, id))
    }

    fn now_millis(&self) -> i64 {
        self.fields.clock.now_micros / 1000
    }

    /// Sets one current counter of every scope, in order, to `values`, and writes what
    /// else each scope changed; `first` are fields to write in the first key too (what
    /// the call remembers there), which is then kept at least until `keep_first`.
    fn write(
        &mut self,
        ctx: &Ctx,
        counter: Kind,
        values: Vec<i64>,
        first: &[(RawString, RawString)],
        keep_first: i64,
    ) {
        let scopes = self.keys.iter_mut().zip(&mut self.scopes).zip(values);
        for (i, ((key, scope), value)) in scopes.enumerate() {
            let (extra, keep) = match i {
                0 => (first, keep_first),
                _ => (&[][..], 0),
            };
            scope.write(ctx, key, &self.fields, counter, value, extra, keep);
        }
    }
}

/// A scope as read: its counters, which of the four counter fields its hash holds, and
/// its open reservations.
struct Scope {
    counters: Counters,
    has_requests: bool,
    has_tokens: bool,
    counted: usize,
    /// Its open reservations (the `holds` field), whether the call changed them, and
    /// whether groups that stopped counting were dropped from them as read (written
    /// only with a write the call makes anyway: a call that changes nothing writes
    /// nothing).
    holds: Holds,
    holds_changed: bool,
    holds_stale: bool,
}

impl Scope {
    /// Reads a scope from `key`, and, given `id`, the value of that field there into its
    /// place (a request id's, read with the scope's own fields beside its counters: a
    /// hash of nothing but counters holds no id). An out place, not a returned pair, so
    /// that the scope is not copied once more on its way into the chain.
    fn read(
        key: &Key,
        fields: &Fields,
        id: Option<(RawString, &mut Option<OwnedString>)>,
    ) -> Scope {
        let values = key.hash_get([
            fields.requests,
            fields.previous_requests,
            fields.tokens,
            fields.previous_tokens,
        ]);
        let value = |i: usize| stored_count(values[i].as_ref().map(OwnedString::bytes));
        let counted = values.iter().flatten().count();
        let mut scope = Scope {
            counters: Counters {
                requests: value(0),
                previous_requests: value(1),
                tokens: value(2),
                previous_tokens: value(3),
                held: 0,
            },
            has_requests: values[0].is_some(),
            has_tokens: values[2].is_some(),
            counted,
            holds: Holds::default(),
            holds_changed: false,
            holds_stale: false,
        };
        // Only a hash with more than its counters can hold reservations or ids (a
        // window's hash holds nothing else but, for a moment, windows that no longer
        // count).
        if key.len() > counted {
            let holds = match id {
                Some((id, id_value)) => {
                    let [holds, value] = key.hash_get([HOLDS.raw(), id]);
                    *id_value = value;
                    holds
                }
                None => {
                    let [holds] = key.hash_get([HOLDS.raw()]);
                    holds
                }
            };
            if let Some(holds) = holds {
                scope.holds = Holds::parse(holds.bytes());
                // Reservations that stopped counting, or end later than any real hold
                // would, go with the scope's next write.
                let now_millis = fields.clock.now_micros / 1000;
                scope.holds_stale = scope
                    .holds
                    .drop_not_counting(now_millis, fields.trusted_until);
                scope.counters.held = scope.holds.tokens();
            }
        }
        scope
    }

    /// Holds `tokens` until `until` too.
    fn hold(&mut self, tokens: i64, until: i64) {
        self.holds.add(Hold { tokens, until });
        self.holds_changed = true;
    }

    /// Releases `tokens` of a reservation held until `until`.
    fn release(&mut self, until: i64, tokens: i64) {
        if tokens > 0 {
            self.holds.release(until, tokens);
            self.holds_changed = true;
        }
    }

    /// Sets one current counter, and, in the same HSET, the scope's reservations when
    /// they changed and `extra`; removes the scope's windows that no longer count (or
    /// never will by this clock) and moves its expiry to the next window's end (see
    /// `Clock::expiry_after_write`), later for the ids its hash remembers, and no earlier
    /// than `keep_until`.
    #[allow(clippy::too_many_arguments)]
    fn write(
        &mut self,
        ctx: &Ctx,
        key: &mut Key,
        fields: &Fields,
        counter: Kind,
        value: i64,
        extra: &[(RawString, RawString)],
        keep_until: i64,
    ) {
        let changes = self.counters.changes(counter, value);
        let (field, had) = match counter {
            Kind::Requests => (fields.requests, self.has_requests),
            Kind::Tokens => (fields.tokens, self.has_tokens),
        };
        let value = OwnedString::from_integer(ctx, value);
        let holds_written =
            self.holds_changed || self.holds_stale && (changes || !extra.is_empty());
        let holds = match holds_written {
            true => Some(
                (!self.holds.is_empty())
                    .then(|| OwnedString::from_text(ctx, |text| self.holds.encode(text))),
            ),
            false => None,
        };
        // The counter, the holds and what the call remembers: one HSET, on the stack.
        let mut writes = [(ptr::null_mut(), ptr::null_mut()); 8];
        let mut n = 0;
        let held = match &holds {
            Some(Some(holds)) => Some((HOLDS.raw(), holds.raw)),
            _ => None,
        };
        let counter = changes.then_some((field, value.raw));
        for write in counter.into_iter().chain(held).chain(extra.iter().copied()) {
            writes[n] = write;
            n += 1;
        }
        if n == 0 && !matches!(holds, Some(None)) {
            return;
        }
        key.set_fields(&writes[..n]);
        if let Some(None) = holds {
            // Nothing held any more: the field goes.
            key.delete_fields(&[HOLDS.raw()]);
        }
        let counted = self.counted + usize::from(changes && !had);
        // A hash that holds more than its counted windows has stale ones, or holds
        // reservations or ids: windows are looked for as they go stale, on a window's
        // first write of a counter (not on every write of a hash that remembers ids).
        if changes && !had && key.len() > counted {
            let stale = key.hash_fields_where(&|name| window::is_stale(name, &fields.clock));
            key.delete_fields(&stale.iter().map(|s| s.raw).collect::<Vec<_>>());
        }
        // A hash with fields beside its counters, as written, may remember ids: its
        // expiry is kept for them (an expiry later than its windows need is not brought
        // back).
        let keep = match key.len() > counted || keep_until > 0 {
            true => replay::keep_until(fields.clock.now_micros / 1000),
            false => 0,
        };
        key.expire_given(|current, _| {
            fields
                .clock
                .expiry_after_write(current, keep)
                .max(keep_until)
        });
    }
}

static ADMIT: CallCounters = CallCounters::new();
static RECORD: CallCounters = CallCounters::new();

/// QAG.ADMIT numscopes key rpm tpm [key rpm tpm ...] [WINDOW seconds] [RESERVE tokens]
/// [ID request-id] [HOLD milliseconds]
pub struct Admit;

impl Command for Admit {
    const NAME: &'static CStr = c"qag.admit";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = -5;
    const KEYS: KeyLayout = KeyLayout::Counted { step: 3 };
    const WRITES: bool = true;
    const SUMMARY: &'static CStr = c"Admits a request only if every scope of a chain is under its requests and tokens per window; replies [admitted, refusing scope, retry after, requests remaining, tokens remaining]";
    const COMPLEXITY: &'static CStr = c"O(N) for N scopes";
    const ARGS: &'static [Arg] = &[
        Arg::integer(c"numscopes"),
        Arg::block(
            c"scope",
            &[
                Arg::key(c"key", 0),
                Arg::integer(c"rpm"),
                Arg::integer(c"tpm"),
            ],
        )
        .multiple(),
        Arg::integer(c"seconds").token(c"WINDOW").optional(),
        Arg::integer(c"tokens").token(c"RESERVE").optional(),
        ID_ARG,
        Arg::integer(c"milliseconds").token(c"HOLD").optional(),
    ];
    const COUNTERS: &'static CallCounters = &ADMIT;
    const OUTCOMES: &'static [&'static str] = &["allowed", "refused"];

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = window::parse_admit(args)?;
        let keys = call.scopes.iter().map(|(key, _)| *key);
        let id = call.id.map(|index| ("admit", index));
        let (mut chain, id) = Chain::open(ctx, args, keys, call.window_seconds, id)?;
        if let Some(reply) = id.as_ref().and_then(RequestId::replay) {
            return Ok(reply);
        }
        let state: Vec<_> = chain
            .scopes
            .iter()
            .zip(&call.scopes)
            .map(|(scope, (_, limits))| (*limits, scope.counters))
            .collect();
        let admission = window::admit(&state, &chain.fields.clock, call.reserve);
        let reply = Reply::Array(admission.as_reply().into());
        // A new id (a replay was answered above): its reservation is held on every
        // scope, and remembered with the reply in the first key, where RECORD finds it.
        let hold = (admission.admitted && call.reserve > 0).then(|| Reserved {
            tokens: call.reserve,
            until: chain.fields.clock.hold_expires_at(call.hold_millis),
            chain: replay_core::chain_of(call.scopes.iter().map(|(key, _)| args.get(*key))),
            charged: 0,
            committed: false,
        });
        let now_millis = chain.now_millis();
        let trusted_until = chain.fields.trusted_until;
        // A refused reservation holds nothing and is not remembered: the request may
        // reserve again under its id once tokens are free (its retry is no replay).
        let remembered = id.filter(|_| admission.admitted || call.reserve == 0);
        let remembered = remembered.map(|id| {
            id.remember_holding(
                ctx,
                &mut chain.keys[0],
                &reply,
                hold,
                now_millis,
                trusted_until,
            )
        });
        let first = remembered.as_ref().map(Remembered::field);
        let keep_first = remembered.as_ref().map_or(0, |r| r.keep_until);
        if admission.admitted {
            if let Some(hold) = hold {
                for scope in chain.scopes.iter_mut() {
                    scope.hold(hold.tokens, hold.until);
                }
            }
            let requests = state
                .iter()
                .map(|(_, counters)| counters.requests.saturating_add(1))
                .collect();
            chain.write(ctx, Kind::Requests, requests, first.as_slice(), keep_first);
        } else if let Some(field) = first {
            // A refusal writes no counter: only the id, kept its time.
            chain.keys[0].set_fields(&[field]);
            chain.keys[0].expire_given(|current, _| current.max(keep_first));
        }
        ADMIT.allowed_or_refused(admission.admitted);
        Ok(reply)
    }
}

/// QAG.RECORD numscopes key [key ...] tokens [WINDOW seconds] [ID request-id [PARTIAL]]
pub struct Record;

impl Command for Record {
    const NAME: &'static CStr = c"qag.record";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = -4;
    const KEYS: KeyLayout = KeyLayout::Counted { step: 1 };
    const WRITES: bool = true;
    const SUMMARY: &'static CStr =
        c"Charges a response's tokens to the current window of every scope; replies the number of scopes charged";
    const COMPLEXITY: &'static CStr = c"O(N) for N scopes";
    const ARGS: &'static [Arg] = &[
        Arg::integer(c"numscopes"),
        Arg::key(c"key", 0).multiple(),
        Arg::integer(c"tokens"),
        Arg::integer(c"seconds").token(c"WINDOW").optional(),
        ID_ARG,
        Arg::word(c"PARTIAL").optional(),
    ];
    const COUNTERS: &'static CallCounters = &RECORD;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = window::parse_record(args)?;
        let keys = call.keys.iter().copied();
        // A partial charge is one of many under the reservation's id: never a replay.
        let id = call
            .id
            .filter(|_| !call.partial)
            .map(|index| ("record", index));
        let (mut chain, id) = Chain::open(ctx, args, keys, call.window_seconds, id)?;
        let (now_millis, trusted_until) = (chain.now_millis(), chain.fields.trusted_until);
        // The reservation this charges, remembered by its ADMIT in the first key: a
        // partial charge pays `tokens` early and releases as much of the hold; the commit
        // charges its count, `tokens`, less what the partials paid, and releases the rest.
        // Looked for before the call's own id: a plain record on another chain may have
        // used that id in this key, and must not stand for the commit.
        let keys = replay_core::chain_of(call.keys.iter().map(|key| args.get(*key)));
        let reservation = call.id.and_then(|id| {
            let first = &chain.keys[0];
            Reservation::find(ctx, first, args, id.index, keys, now_millis, trusted_until)
        });
        match &reservation {
            // The commit's count covered it: the commit sent again (a replay), or a
            // partial run late. Nothing to charge, nothing written.
            Some(r) if r.reserved.committed => {
                if !call.partial {
                    crate::stats::replayed();
                }
                return Ok(Reply::Integer(chain.keys.len() as i64));
            }
            Some(_) => {}
            // A plain record: replayable under its own id.
            None => {
                if let Some(reply) = id.as_ref().and_then(RequestId::replay) {
                    return Ok(reply);
                }
            }
        }
        // A commit settles the count: less than the partials paid (one sent twice) takes
        // the difference back from the current window, down to nothing.
        let charge = match (&reservation, call.partial) {
            (Some(r), false) => call.tokens.saturating_sub(r.reserved.charged),
            _ => call.tokens,
        };
        // Every new count is computed, and checked, before any is written.
        let totals = chain
            .scopes
            .iter()
            .map(|scope| scope.counters.tokens.checked_add(charge).map(|t| t.max(0)))
            .collect::<Option<Vec<i64>>>()
            .ok_or(CommandError::Refused(
                "ERR the token count would overflow; nothing was charged",
            ))?;
        // The ADMIT's record of the reservation, rewritten with what is left of it.
        let settled = reservation.map(|reservation| {
            let held = reservation.reserved;
            let released = match (reservation.open, call.partial) {
                (false, _) => 0,
                (true, true) => call.tokens.min(held.tokens),
                (true, false) => held.tokens,
            };
            for scope in chain.scopes.iter_mut() {
                scope.release(held.until, released);
            }
            let partial = call.partial.then_some((call.tokens, released));
            reservation.after(ctx, partial, now_millis)
        });
        let reply = Reply::Integer(chain.keys.len() as i64);
        // A commit is remembered in the ADMIT's record alone (marked committed), not under
        // the RECORD's id, which stays another chain's to use.
        let remembered = id.filter(|_| settled.is_none()).map(|id| {
            id.remember_holding(
                ctx,
                &mut chain.keys[0],
                &reply,
                None,
                now_millis,
                trusted_until,
            )
        });
        let first = settled
            .as_ref()
            .map(|(field, value)| (field.raw, value.raw))
            .or(remembered.as_ref().map(Remembered::field));
        // The ADMIT's record, rewritten, is kept as long as it is remembered.
        let keep_first = match &settled {
            Some(_) => replay::keep_until(now_millis),
            None => remembered.as_ref().map_or(0, |r| r.keep_until),
        };
        chain.write(ctx, Kind::Tokens, totals, first.as_slice(), keep_first);
        Ok(reply)
    }
}
