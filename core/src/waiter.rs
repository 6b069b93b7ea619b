//! One waiter's life (`WAIT ms`), and one request's charge shared by the calls that wait
//! on it: the decisions, free of the server's API. The module's glue (src/wait.rs) only
//! performs the effects each step names.
//!
//! A waiter blocks, and then whichever of its ends comes first wins: served, refused
//! (its wait ran out, or the module gave it up), its client gone (a closed connection,
//! CLIENT KILL, CLIENT UNBLOCK … ERROR, a primary turned replica) or CLIENT UNBLOCK
//! (the server's timeout callback). Every later end is a no-op. A waiter answered (the
//! module called `RM_UnblockClient` with its answer) is still the server's until the
//! server calls back: to write the answer (the reply callback, only while its client is
//! there) and to free it (always). An answer freed unwritten releases what it held.
//!
//! An answer written stands: the server sends it at the end of the event loop's turn,
//! and a client found gone only then (its connection reset while the server was busy)
//! cannot be told from one that read its answer and closed, which a give-back would let
//! take beyond its limit (the strict side: what it was given stays taken).
//!
//! What the module must never do, and what the steps here make impossible: unblock a
//! client twice (the server would free its handle twice), reply to a client after
//! unblocking it, write an answer twice, give back a charge whose answer was written,
//! or keep a charge whose answer never was.

use std::collections::HashMap;
use std::hash::Hash;

/// Where a waiter is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Blocked, neither served nor refused.
    Waiting,
    /// Given its answer (`RM_UnblockClient` with it), not yet written. `holds`: the answer
    /// carries what the waiter was charged or given (a served take's tokens, a lease's
    /// slot), released if it is never written.
    Answered { holds: bool },
    /// Its answer written to its client: what it held stands.
    Replied,
    /// Nothing more happens to it; the module forgets it.
    Ended,
}

/// What happens to a waiter: the module's decisions and the server's callbacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// The module served it: its time came, or a slot was given to it.
    Served,
    /// The module refused it: its wait ran out, or its key can never give it a slot.
    Refused,
    /// The server's disconnect callback: its client is going (connection closed, CLIENT
    /// KILL, CLIENT UNBLOCK … ERROR, a primary turned replica), or was unblocked by the
    /// server after its answer was given.
    Disconnected,
    /// The server's timeout callback: CLIENT UNBLOCK (… TIMEOUT).
    Unblocked,
    /// The server's reply callback: write the answer now.
    Reply,
    /// The server's free callback: the answer's handle is freed, written or not.
    Free,
}

/// How the module calls `RM_UnblockClient`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unblock {
    /// With its answer: the server calls back to write it (if its client is still there)
    /// and to free it.
    WithAnswer,
    /// With no answer: the server only frees its handle; no callback comes.
    Bare,
}

/// What becomes of what a waiter was charged (or given).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Charge {
    /// Its allowed answer was written to its client: the charge stands.
    Stands,
    /// It was never answered allowed: given back.
    Released,
}

/// What the glue does for one event, in the order of the fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// The stage after the event.
    pub stage: Stage,
    /// Stop its timer and take it out of its keys' queues: it waits no more.
    pub stop_waiting: bool,
    /// Reply its refusal now, into the callback's own context (CLIENT UNBLOCK's).
    pub refuse_here: bool,
    pub unblock: Option<Unblock>,
    /// Write its answer, in the reply callback.
    pub write_answer: bool,
    pub charge: Option<Charge>,
}

impl Step {
    fn to(stage: Stage) -> Step {
        Step {
            stage,
            stop_waiting: false,
            refuse_here: false,
            unblock: None,
            write_answer: false,
            charge: None,
        }
    }

    /// Whether the event changed nothing.
    pub fn is_no_op(&self, before: Stage) -> bool {
        *self == Step::to(before)
    }
}

/// The step a waiter at `stage` takes on `event`. An event that cannot (or can no
/// longer) act on it is a no-op: a served waiter's client going (the free callback
/// decides), CLIENT UNBLOCK after its answer was given, a second answer.
pub fn step(stage: Stage, event: Event) -> Step {
    use Event::*;
    use Stage::*;
    let stay = Step::to(stage);
    match (stage, event) {
        (Waiting, Served) => Step {
            stop_waiting: true,
            unblock: Some(Unblock::WithAnswer),
            ..Step::to(Answered { holds: true })
        },
        (Waiting, Refused) => Step {
            stop_waiting: true,
            unblock: Some(Unblock::WithAnswer),
            charge: Some(Charge::Released),
            ..Step::to(Answered { holds: false })
        },
        (Waiting, Disconnected) => Step {
            stop_waiting: true,
            unblock: Some(Unblock::Bare),
            charge: Some(Charge::Released),
            ..Step::to(Ended)
        },
        (Waiting, Unblocked) => Step {
            stop_waiting: true,
            refuse_here: true,
            unblock: Some(Unblock::Bare),
            charge: Some(Charge::Released),
            ..Step::to(Ended)
        },
        (Answered { holds }, Reply) => Step {
            write_answer: true,
            charge: holds.then_some(Charge::Stands),
            ..Step::to(Replied)
        },
        (Answered { holds }, Free) => Step {
            charge: holds.then_some(Charge::Released),
            ..Step::to(Ended)
        },
        (Replied, Free) => Step::to(Ended),
        _ => stay,
    }
}

/// One request's charge shared by the call that was charged for it and the replays of
/// its request id that wait on it (a client that lost its connection sends the call
/// again under the same id; the replay waits for the first call's time, charging
/// nothing). The charge stands if any of them was answered allowed; it is given back
/// only once all of them are gone unanswered, and never while a replay still waits on
/// it. `K` names a request (its key and id), `H` is what gives the charge back.
pub struct Shares<K, H> {
    by_request: HashMap<K, u64>,
    shares: HashMap<u64, Share<K, H>>,
}

struct Share<K, H> {
    request: K,
    /// Calls on it not yet ended.
    live: u32,
    /// Whether one was answered allowed.
    stands: bool,
    /// What gives the charge back, left by the charged call when it ended unanswered.
    give_back: Option<H>,
}

/// What a member's end leaves to do.
#[derive(Debug, PartialEq, Eq)]
pub enum Settled {
    /// Nothing yet, or nothing ever: another call still waits on the charge, or it
    /// stands.
    Nothing,
    /// Every call on it is gone unanswered: give it back, a moment later, through
    /// `Shares::give_back` (a replay may still come before then, and keep it).
    GiveBack(u64),
}

impl<K: Clone + Eq + Hash, H> Default for Shares<K, H> {
    fn default() -> Self {
        Shares {
            by_request: HashMap::new(),
            shares: HashMap::new(),
        }
    }
}

impl<K: Clone + Eq + Hash, H> Shares<K, H> {
    /// The call charged for `request` waits; `id` names its share (the waiter's number,
    /// never reused). A share left of an earlier call under the same request (its id
    /// gone from its key: deleted, flushed) is no longer found by replays.
    pub fn charge(&mut self, id: u64, request: K) {
        self.by_request.insert(request.clone(), id);
        self.shares.insert(
            id,
            Share {
                request,
                live: 1,
                stands: false,
                give_back: None,
            },
        );
    }

    /// A replay of `request` waits on its charge: the share it joined, if the charged
    /// call's share is still here (else the charge was decided already: it holds
    /// nothing). A share whose give-back is due but not yet made is kept by it.
    pub fn join(&mut self, request: &K) -> Option<u64> {
        let id = *self.by_request.get(request)?;
        let share = self.shares.get_mut(&id)?;
        share.live += 1;
        Some(id)
    }

    /// A replay of `request` was answered allowed at once (its time had come): the
    /// charge stands.
    pub fn stand(&mut self, request: &K) {
        if let Some(share) = self
            .by_request
            .get(request)
            .and_then(|id| self.shares.get_mut(id))
        {
            share.stands = true;
        }
    }

    /// A call on share `id` ended: `charge` says whether it was answered allowed;
    /// `give_back` is what gives the charge back, from the charged call only.
    pub fn end(&mut self, id: u64, charge: Charge, give_back: Option<H>) -> Settled {
        let Some(share) = self.shares.get_mut(&id) else {
            return Settled::Nothing;
        };
        share.live = share.live.saturating_sub(1);
        match charge {
            Charge::Stands => share.stands = true,
            Charge::Released => {
                if give_back.is_some() {
                    share.give_back = give_back;
                }
            }
        }
        match (share.live, share.stands) {
            (0, true) => {
                self.remove(id);
                Settled::Nothing
            }
            (0, false) => Settled::GiveBack(id),
            _ => Settled::Nothing,
        }
    }

    /// The give-back of share `id`, now due: what gives it back, unless a replay joined
    /// since (its own end decides again) or the charge stood.
    pub fn give_back(&mut self, id: u64) -> Option<H> {
        let share = self.shares.get(&id)?;
        if share.live > 0 {
            return None;
        }
        self.remove(id).and_then(|share| match share.stands {
            true => None,
            false => share.give_back,
        })
    }

    fn remove(&mut self, id: u64) -> Option<Share<K, H>> {
        let share = self.shares.remove(&id)?;
        if self.by_request.get(&share.request) == Some(&id) {
            self.by_request.remove(&share.request);
        }
        Some(share)
    }

    /// How many shares are kept (for tests and INFO: none once every waiter is gone and
    /// every give-back made).
    pub fn len(&self) -> usize {
        self.shares.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shares.is_empty()
    }
}

/// Give-backs on one key, batched: for each waiter in `queue` (arrival numbers, in
/// order), the sum of the `give_backs` (arrival number, amount) of waiters that came
/// before it. Each waiter behind a give-back comes sooner by what was given back ahead
/// of it, and its timer is moved once however many gave back.
pub fn sooner_by(queue: &[u64], give_backs: &[(u64, f64)]) -> Vec<(u64, f64)> {
    let mut sorted: Vec<(u64, f64)> = give_backs.to_vec();
    sorted.sort_by_key(|&(seq, _)| seq);
    let mut ahead = sorted.iter().peekable();
    let mut total = 0.0;
    let mut moved = Vec::new();
    for &seq in queue {
        while let Some(&&(before, amount)) = ahead.peek() {
            if before >= seq {
                break;
            }
            total += amount;
            ahead.next();
        }
        if total > 0.0 {
            moved.push((seq, total));
        }
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The server's side of one blocked client, as Redis 7.0 and 7.2 and later (Valkey
    /// among them) run it (module.c, blocked.c, networking.c, server.c's beforeSleep),
    /// driving a waiter through `step` exactly as the glue does.
    #[derive(Clone, Debug)]
    struct Server {
        /// CLIENT UNBLOCK on a client already given its answer: 7.0 calls no timeout
        /// callback and unblocks it anyway (calling the disconnect callback); 7.2 and
        /// later leave it blocked to get its answer.
        newer: bool,
        /// The client, until the server frees it.
        alive: bool,
        /// Its peer reset the connection: the server finds out at its next write or
        /// read.
        reset: bool,
        /// CLIENT_BLOCKED.
        blocked: bool,
        /// bc->client: the client, until the server unblocks or frees it.
        bc_client: bool,
        /// bc->unblocked: RM_UnblockClient was called.
        bc_unblocked: bool,
        /// Times the handle is in the list of unblocked clients.
        queued: u32,
        /// The privdata the module gave: whether it was an answer.
        privdata: bool,
        disconnect_callback: bool,
        bc_freed: bool,
        /// What waits in the client's output: an answer written, a refusal, an error.
        output: Vec<&'static str>,
        /// What was written to the client's output, and what of it was sent.
        written: Vec<&'static str>,
        sent: Vec<&'static str>,
        stage: Stage,
        /// The answer given was a served one (else a refusal).
        served: bool,
        stands: u32,
        released: u32,
        violations: Vec<String>,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Happens {
        /// The module's timer or a freed slot serves it.
        Serve,
        /// Its wait runs out.
        Refuse,
        /// Its connection closes, or CLIENT KILL: the server frees it now.
        Close,
        /// Its peer resets the connection while the server is busy: found at the next
        /// write, or the next read.
        Reset,
        UnblockTimeout,
        UnblockError,
        /// REPLICAOF: every blocked client unblocked with an error and closed after.
        Demote,
        /// The event loop's turn ends (beforeSleep: blocked clients answered, output
        /// sent, clients closed asynchronously freed; afterSleep) and the next one reads.
        Turn,
    }

    const EVERYTHING: [Happens; 8] = [
        Happens::Serve,
        Happens::Refuse,
        Happens::Close,
        Happens::Reset,
        Happens::UnblockTimeout,
        Happens::UnblockError,
        Happens::Demote,
        Happens::Turn,
    ];

    impl Server {
        fn new(newer: bool) -> Server {
            Server {
                newer,
                alive: true,
                reset: false,
                blocked: true,
                bc_client: true,
                bc_unblocked: false,
                queued: 0,
                privdata: false,
                disconnect_callback: true,
                bc_freed: false,
                output: Vec::new(),
                written: Vec::new(),
                sent: Vec::new(),
                stage: Stage::Waiting,
                served: false,
                stands: 0,
                released: 0,
                violations: Vec::new(),
            }
        }

        /// The module's handling of `event` (the glue): the step's effects.
        fn module(&mut self, event: Event, in_timeout_callback: bool) {
            let before = self.stage;
            if before == Stage::Ended {
                // Forgotten: the glue finds no waiter for the handle, and does nothing.
                return;
            }
            let step = step(before, event);
            if step.refuse_here {
                if !in_timeout_callback || !self.bc_client {
                    self.violations
                        .push(format!("refused outside a timeout callback: {event:?}"));
                }
                self.output.push("refusal");
                self.written.push("refusal");
            }
            if let Some(unblock) = step.unblock {
                if self.bc_freed {
                    self.violations.push("unblocked a freed handle".into());
                }
                if self.bc_unblocked {
                    self.violations.push("unblocked twice".into());
                }
                self.bc_unblocked = true;
                self.queued += 1;
                self.privdata = unblock == Unblock::WithAnswer;
                self.served = event == Event::Served;
            }
            if step.write_answer {
                if !self.bc_client {
                    self.violations.push("wrote to a client gone".into());
                }
                let what = if self.served { "answer" } else { "refusal" };
                self.output.push(what);
                self.written.push(what);
            }
            match step.charge {
                Some(Charge::Stands) => self.stands += 1,
                Some(Charge::Released) => self.released += 1,
                None => {}
            }
            self.stage = step.stage;
        }

        /// unblockClientFromModule: the disconnect callback, then the handle loses its
        /// client.
        fn unblock_from_module(&mut self) {
            if self.disconnect_callback {
                self.module(Event::Disconnected, false);
            }
            self.bc_client = false;
            self.blocked = false;
        }
        /// freeClient: unblocked if blocked; its output lost.
        fn free_client(&mut self) {
            if !self.alive {
                return;
            }
            if self.blocked {
                self.unblock_from_module();
            }
            self.alive = false;
            self.output.clear();
        }

        fn happen(&mut self, what: Happens) {
            match what {
                Happens::Serve if self.stage == Stage::Waiting => self.module(Event::Served, false),
                Happens::Refuse if self.stage == Stage::Waiting => {
                    self.module(Event::Refused, false)
                }
                Happens::Serve | Happens::Refuse => {}
                Happens::Close => self.free_client(),
                Happens::Reset => self.reset = true,
                Happens::UnblockTimeout => {
                    if !(self.alive && self.blocked) {
                        return;
                    }
                    if self.bc_unblocked && self.newer {
                        return;
                    }
                    if !self.bc_unblocked {
                        self.module(Event::Unblocked, true);
                        self.disconnect_callback = false;
                    }
                    self.unblock_from_module();
                }
                Happens::UnblockError | Happens::Demote => {
                    if !(self.alive && self.blocked) {
                        return;
                    }
                    self.output.push("error");
                    self.unblock_from_module();
                }
                Happens::Turn => self.turn(what),
            }
            if what == Happens::Demote && self.output.contains(&"error") {
                // Closed once its error is sent.
                self.turn(what);
                self.free_client();
            }
        }

        fn turn(&mut self, _why: Happens) {
            // moduleHandleBlockedClients.
            while self.queued > 0 {
                if self.bc_freed {
                    self.violations
                        .push("the server used a freed handle".into());
                    return;
                }
                self.queued -= 1;
                if self.bc_client {
                    self.module(Event::Reply, false);
                }
                if self.privdata {
                    self.module(Event::Free, false);
                }
                if self.bc_client {
                    self.disconnect_callback = false;
                    self.blocked = false;
                    self.bc_client = false;
                }
                self.bc_freed = true;
            }
            // The output is sent; a reset connection is found, and freed.
            if self.alive && !self.output.is_empty() {
                if self.reset {
                    self.free_client();
                } else {
                    self.sent.append(&mut self.output);
                }
            } // The next turn reads a reset connection.
            if self.reset {
                self.free_client();
            }
        }

        /// After the schedule: its wait runs out if it still waits, and the turn ends.
        fn finish(&mut self) {
            self.happen(Happens::Turn);
            self.happen(Happens::Refuse);
            self.happen(Happens::Turn);
        }

        fn check(&self, schedule: &[Happens]) {
            let fail = |what: &str| {
                panic!(
                    "{what} after {schedule:?} (newer: {}): {self:#?}",
                    self.newer
                )
            };
            if !self.violations.is_empty() {
                fail(&self.violations.join("; "));
            }
            if self.stage != Stage::Ended {
                fail("a waiter never ended");
            }
            if !self.bc_freed {
                fail("the handle was never freed");
            }
            if self.sent.len() > 1 {
                fail("more than one reply");
            }
            // A client still there got its one reply, but on 7.0 a CLIENT UNBLOCK …
            // TIMEOUT of one given its answer in the same turn: the server unblocks it
            // with nothing to say (its answer, given back, goes unsent).
            let unblocked_answered_70 = !self.newer && schedule.contains(&Happens::UnblockTimeout);
            if self.alive && self.sent.is_empty() && !unblocked_answered_70 {
                fail("a client still there got no reply");
            } // The charge: stands exactly when a served answer was written (sent, or lost
              // to a client found gone only when it was sent: the strict side).
            let expected = match self.written.contains(&"answer") {
                true => (1, 0),
                false => (0, 1),
            };
            if (self.stands, self.released) != expected {
                fail("the charge was not settled once, as its answer's fate says");
            }
        }
    }

    fn schedules(len: usize) -> Vec<Vec<Happens>> {
        let mut all = vec![Vec::new()];
        for _ in 0..len {
            all = all
                .into_iter()
                .flat_map(|prefix| {
                    EVERYTHING.iter().map(move |&next| {
                        let mut s = prefix.clone();
                        s.push(next);
                        s
                    })
                })
                .collect();
        }
        all
    }

    #[test]
    fn every_order_of_a_waiters_ends_is_safe_on_every_server() {
        let mut runs = 0;
        for len in 0..=6 {
            for schedule in schedules(len) {
                for newer in [false, true] {
                    let mut server = Server::new(newer);
                    for &what in &schedule {
                        server.happen(what);
                    }
                    server.finish();
                    server.check(&schedule);
                    runs += 1;
                }
            }
        }
        // 8^0 + … + 8^6 schedules, on both kinds of server.
        assert_eq!(runs, 2 * (0..=6).map(|n| 8usize.pow(n)).sum::<usize>());
    }

    /// The review's crash, by hand: served, then gone in the same turn.
    #[test]
    fn a_waiter_served_then_gone_unblocks_once_and_gives_back() {
        for gone in [Happens::Close, Happens::UnblockError, Happens::Demote] {
            let mut server = Server::new(false);
            server.happen(Happens::Serve);
            server.happen(gone);
            server.happen(Happens::Turn);
            assert!(
                server.violations.is_empty(),
                "{gone:?}: {:?}",
                server.violations
            );
            assert!(server.written.is_empty(), "{gone:?}");
            assert_eq!((server.stands, server.released), (0, 1), "{gone:?}");
        }
    }

    /// Served, its answer written, its client found gone only when it is sent: the
    /// server cannot tell that from a client that read it and closed. It stands.
    #[test]
    fn an_answer_written_to_a_client_found_gone_at_the_send_stands() {
        let mut server = Server::new(false);
        server.happen(Happens::Serve);
        server.happen(Happens::Reset);
        server.happen(Happens::Turn);
        assert!(server.violations.is_empty(), "{:?}", server.violations);
        assert_eq!(
            (server.written.clone(), server.sent.clone()),
            (vec!["answer"], vec![])
        );
        assert_eq!((server.stands, server.released), (1, 0));
    }

    #[test]
    fn every_step_names_its_effects() {
        use Event::*;
        use Stage::*;
        let s = step(Waiting, Served);
        assert_eq!(
            (s.stage, s.stop_waiting, s.unblock, s.charge),
            (
                Answered { holds: true },
                true,
                Some(Unblock::WithAnswer),
                None
            )
        );
        let s = step(Waiting, Unblocked);
        assert!(s.refuse_here && s.unblock == Some(Unblock::Bare));
        assert_eq!(s.charge, Some(Charge::Released));
        let held = Answered { holds: true };
        assert_eq!(step(held, Reply).stage, Replied);
        assert_eq!(step(held, Reply).charge, Some(Charge::Stands));
        assert_eq!(step(Answered { holds: false }, Reply).charge, None);
        assert_eq!(step(held, Free).charge, Some(Charge::Released));
        assert_eq!(step(Replied, Free), Step::to(Ended));
        for stage in [held, Replied, Ended] {
            for event in [Served, Refused, Disconnected, Unblocked] {
                assert!(step(stage, event).is_no_op(stage), "{stage:?} {event:?}");
            }
        }
        for event in [Reply, Free] {
            assert!(step(Waiting, event).is_no_op(Waiting), "{event:?}");
        }
        assert!(step(Ended, Free).is_no_op(Ended));
    }

    /// The calls on one request's charge: the charged call (0) and two replays (1, 2),
    /// each of which joins (or, its time come, is answered at once), and ends answered
    /// allowed or not; give-backs run when the schedule says.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Share {
        Join(usize),
        AnsweredAtOnce,
        End(usize, Charge),
        GiveBacks,
    }

    #[test]
    fn a_charge_shared_by_replays_is_given_back_once_and_only_when_none_was_answered() {
        let alphabet = [
            Share::Join(1),
            Share::Join(2),
            Share::AnsweredAtOnce,
            Share::End(0, Charge::Stands),
            Share::End(0, Charge::Released),
            Share::End(1, Charge::Stands),
            Share::End(1, Charge::Released),
            Share::End(2, Charge::Stands),
            Share::End(2, Charge::Released),
            Share::GiveBacks,
        ];
        let mut schedules: Vec<Vec<Share>> = vec![Vec::new()];
        let mut checked = 0;
        for _ in 0..7 {
            let mut longer = Vec::new();
            for schedule in &schedules {
                for &next in &alphabet {
                    let mut s = schedule.clone();
                    s.push(next);
                    if possible(&s) {
                        longer.push(s);
                    }
                }
            }
            for schedule in &longer {
                run_shares(schedule);
                checked += 1;
            }
            schedules = longer;
        }
        assert!(checked > 10_000, "{checked}");
    }

    /// A schedule the module can produce: a member joins once before it ends, ends once.
    fn possible(schedule: &[Share]) -> bool {
        let mut joined = [true, false, false];
        let mut ended = [false; 3];
        for &s in schedule {
            match s {
                Share::Join(m) if joined[m] => return false,
                Share::Join(m) => joined[m] = true,
                Share::End(m, _) if !joined[m] || ended[m] => return false,
                Share::End(m, _) => ended[m] = true,
                _ => {}
            }
        }
        true
    }

    fn run_shares(schedule: &[Share]) {
        let mut shares: Shares<&str, &str> = Shares::default();
        shares.charge(7, "request");
        let mut member = [Some(7), None, None];
        let mut due = Vec::new();
        let mut given_back = 0;
        let mut stood = false;
        let mut gone = false;
        let give_backs = |shares: &mut Shares<&str, &str>, due: &mut Vec<u64>, given: &mut u32| {
            for id in due.drain(..) {
                if let Some(what) = shares.give_back(id) {
                    assert_eq!(what, "refund");
                    *given += 1;
                }
            }
        };
        for &s in schedule {
            match s {
                Share::Join(m) => {
                    member[m] = shares.join(&"request");
                    // A charge given back cannot be joined (the request id is gone from
                    // its key: a replay is a new call); one that stood needs no more.
                    assert!(member[m].is_some() || gone || stood, "{schedule:?}");
                    assert!(member[m].is_none() || !gone, "{schedule:?}");
                }
                Share::AnsweredAtOnce => {
                    if !gone {
                        shares.stand(&"request");
                        stood = true;
                    }
                }
                Share::End(m, charge) => {
                    let Some(id) = member[m] else { continue };
                    stood |= charge == Charge::Stands;
                    let refund = (m == 0 && charge == Charge::Released).then_some("refund");
                    if let Settled::GiveBack(id) = shares.end(id, charge, refund) {
                        due.push(id);
                    }
                }
                Share::GiveBacks => {
                    give_backs(&mut shares, &mut due, &mut given_back);
                    gone = given_back > 0;
                }
            }
            assert!(given_back <= 1, "given back twice: {schedule:?}");
            assert!(
                !(stood && given_back > 0),
                "a charge that stood was given back: {schedule:?}"
            );
        }
        give_backs(&mut shares, &mut due, &mut given_back);
        let live_members = member
            .iter()
            .enumerate()
            .filter(|(m, id)| {
                id.is_some()
                    && !schedule
                        .iter()
                        .any(|s| matches!(s, Share::End(e, _) if e == m))
            })
            .count();
        if live_members == 0 && !stood {
            assert_eq!(given_back, 1, "never given back: {schedule:?}");
        }
        if live_members == 0 {
            assert!(shares.is_empty(), "a share kept: {schedule:?}");
        }
    }

    #[test]
    fn a_give_back_moves_each_waiter_behind_it_once_by_all_given_ahead() {
        let queue = [3, 5, 8, 9];
        let moved = sooner_by(&queue, &[(4, 1.0), (1, 0.5), (8, 2.0)]);
        assert_eq!(moved, vec![(3, 0.5), (5, 1.5), (8, 1.5), (9, 3.5)]);
        assert!(sooner_by(&queue, &[(10, 1.0)]).is_empty());
        assert!(sooner_by(&[], &[(1, 1.0)]).is_empty());
    }
}
