//! Commands that exist only to test the module's own safety nets; registered only when
//! the module is loaded with the argument `TEST-COMMANDS`.

use std::ffi::CStr;

use crate::command::{Arg, Command, KeyLayout, RawArgs, Reply};
use crate::server::{CommandError, Ctx};
use crate::stats::CallCounters;

static PANIC: CallCounters = CallCounters::new();

/// QAG.TEST.PANIC key: panics inside the command, to show that the guard turns a
/// panic into an error reply and the server lives on.
pub struct Panic;

impl Command for Panic {
    const NAME: &'static CStr = c"qag.test.panic";
    const FLAGS: &'static CStr = c"readonly";
    const ARITY: i32 = 2;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = false;
    const SUMMARY: &'static CStr = c"Test only: panics, to exercise the panic guard";
    const COMPLEXITY: &'static CStr = c"O(1)";
    const ARGS: &'static [Arg] = &[Arg::key(c"key", 0)];
    const COUNTERS: &'static CallCounters = &PANIC;

    fn run(_ctx: &Ctx, _args: &RawArgs) -> Result<Reply, CommandError> {
        panic!("QAG.TEST.PANIC was called");
    }
}
