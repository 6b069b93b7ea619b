//! What every qag command shares: the entry point Redis calls, the guard that turns a
//! panic into an error reply, the reply path, and registration with key specs and docs
//! (the call's context, its clock and replication are server.rs's).

use std::ffi::{c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use qag_core::args::{counted_key_positions, ArgError, ArgList};
use qag_core::window::MAX_SCOPES;
use redis_module::commands::{get_redis_key_spec, BeginSearch, FindKeys, KeySpec, KeySpecFlags};
use redis_module::raw;

use crate::server::{string_bytes, CommandError, Ctx};
use crate::stats::{self, CallCounters};

/// A command's arguments as Redis passed them; read in place, never copied.
pub struct RawArgs {
    argv: *mut *mut raw::RedisModuleString,
    argc: usize,
}

/// A reply, written only after the command has done all its work, so that a failure
/// can never leave half a reply on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// One integer.
    Integer(i64),
    /// An array of integers and nulls, e.g. a TAKE's [allowed, tokens left, retry after].
    Array(Row),
    /// Two arrays, the second null when absent (TAKE2's two buckets).
    Pair(Row, Option<Row>),
    /// Nothing now: the client waits (`WAIT ms`), answered later by wait.rs.
    Held,
    /// An error, the whole text: a waiter's answer when it cannot be served here (its
    /// key's slot moved away while it waited).
    Error(&'static str),
}

/// Up to six integers or nulls, kept on the stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    values: [Option<i64>; 6],
    len: usize,
}

impl Row {
    pub fn new(values: &[Option<i64>]) -> Row {
        let mut row = Row {
            values: [None; 6],
            len: values.len(),
        };
        row.values[..values.len()].copy_from_slice(values);
        row
    }

    pub fn values(&self) -> &[Option<i64>] {
        &self.values[..self.len]
    }
}

impl<const N: usize> From<[i64; N]> for Row {
    fn from(values: [i64; N]) -> Row {
        Row::new(&values.map(Some))
    }
}

/// Which arguments are keys, for the server's ACL checks and cluster routing.
pub enum KeyLayout {
    /// One key at argument 1.
    Single,
    /// Keys at arguments 1 and 4 (TAKE2's client and key buckets).
    FirstAndFourth,
    /// As many keys as argument 1 says, from argument 2 on, one every `step` arguments.
    Counted { step: usize },
}

impl KeyLayout {
    /// Whether the module answers the server's key lookups itself (flag
    /// `getkeys-api`): only a counted layout needs it. TAKE2's keys are one range with
    /// a step (arguments 1 to 4, every third), a legacy key range and one key spec, so
    /// the server finds both (CROSSSLOT for two slots, ACL checks on each) and a generic
    /// cluster client routes it from `COMMAND` alone, without `COMMAND GETKEYS` (a
    /// command answering lookups itself is flagged `movablekeys`). A counted layout has
    /// no fixed range, and with a step its key specs cannot say it either: servers read
    /// a key count as a count of arguments.
    fn declared_by_module(&self) -> bool {
        matches!(self, KeyLayout::Counted { .. })
    }
}

/// One argument of a command, as COMMAND DOCS shows it (and redis-cli's hints).
#[derive(Clone, Copy)]
pub struct Arg {
    name: &'static CStr,
    kind: ArgKind,
    /// The word that comes before the value, e.g. `COST`.
    token: Option<&'static CStr>,
    optional: bool,
    multiple: bool,
}

#[derive(Clone, Copy)]
enum ArgKind {
    /// A key, found by the key spec of this index.
    Key(c_int),
    Integer,
    Double,
    String,
    /// A word alone, e.g. `day`.
    PureToken,
    /// Exactly one of these.
    OneOf(&'static [Arg]),
    /// These, in order, as one unit (e.g. an ADMIT scope: key rpm tpm).
    Block(&'static [Arg]),
}

impl Arg {
    const fn new(name: &'static CStr, kind: ArgKind) -> Arg {
        Arg {
            name,
            kind,
            token: None,
            optional: false,
            multiple: false,
        }
    }

    pub const fn key(name: &'static CStr, key_spec: c_int) -> Arg {
        Arg::new(name, ArgKind::Key(key_spec))
    }

    pub const fn integer(name: &'static CStr) -> Arg {
        Arg::new(name, ArgKind::Integer)
    }

    pub const fn double(name: &'static CStr) -> Arg {
        Arg::new(name, ArgKind::Double)
    }

    pub const fn string(name: &'static CStr) -> Arg {
        Arg::new(name, ArgKind::String)
    }

    /// A word alone, e.g. `day`: its name is its token.
    pub const fn word(name: &'static CStr) -> Arg {
        Arg::new(name, ArgKind::PureToken).token(name)
    }

    pub const fn one_of(name: &'static CStr, choices: &'static [Arg]) -> Arg {
        Arg::new(name, ArgKind::OneOf(choices))
    }

    pub const fn block(name: &'static CStr, parts: &'static [Arg]) -> Arg {
        Arg::new(name, ArgKind::Block(parts))
    }

    pub const fn token(self, token: &'static CStr) -> Arg {
        Arg {
            token: Some(token),
            ..self
        }
    }

    pub const fn optional(self) -> Arg {
        Arg {
            optional: true,
            ..self
        }
    }

    pub const fn multiple(self) -> Arg {
        Arg {
            multiple: true,
            ..self
        }
    }
}

/// `[ID request-id [KEEP seconds]]`, on every command that counts.
pub const ID_ARG: Arg = Arg::block(
    c"id",
    &[
        Arg::string(c"request-id").token(c"ID"),
        Arg::integer(c"seconds").token(c"KEEP").optional(),
    ],
)
.optional();

/// `[WAIT ms]`, on every command that may wait for its turn.
pub const WAIT_ARG: Arg = Arg::integer(c"ms").token(c"WAIT").optional();

/// `args` as the server's argument table: NULL-name terminated arrays, nested ones kept
/// alive in `arena` until the server has copied them.
fn raw_args(
    args: &[Arg],
    arena: &mut Vec<Vec<raw::RedisModuleCommandArg>>,
) -> *mut raw::RedisModuleCommandArg {
    let mut table: Vec<raw::RedisModuleCommandArg> = args
        .iter()
        .map(|arg| {
            let (type_, key_spec_index, subargs) = match arg.kind {
                ArgKind::Key(spec) => (
                    raw::RedisModuleCommandArgType_REDISMODULE_ARG_TYPE_KEY,
                    spec,
                    ptr::null_mut(),
                ),
                ArgKind::Integer => (
                    raw::RedisModuleCommandArgType_REDISMODULE_ARG_TYPE_INTEGER,
                    -1,
                    ptr::null_mut(),
                ),
                ArgKind::Double => (
                    raw::RedisModuleCommandArgType_REDISMODULE_ARG_TYPE_DOUBLE,
                    -1,
                    ptr::null_mut(),
                ),
                ArgKind::String => (
                    raw::RedisModuleCommandArgType_REDISMODULE_ARG_TYPE_STRING,
                    -1,
                    ptr::null_mut(),
                ),
                ArgKind::PureToken => (
                    raw::RedisModuleCommandArgType_REDISMODULE_ARG_TYPE_PURE_TOKEN,
                    -1,
                    ptr::null_mut(),
                ),
                ArgKind::OneOf(choices) => (
                    raw::RedisModuleCommandArgType_REDISMODULE_ARG_TYPE_ONEOF,
                    -1,
                    raw_args(choices, arena),
                ),
                ArgKind::Block(parts) => (
                    raw::RedisModuleCommandArgType_REDISMODULE_ARG_TYPE_BLOCK,
                    -1,
                    raw_args(parts, arena),
                ),
            };
            let flags = if arg.optional {
                raw::REDISMODULE_CMD_ARG_OPTIONAL
            } else {
                0
            } | if arg.multiple {
                raw::REDISMODULE_CMD_ARG_MULTIPLE
            } else {
                0
            };
            raw::RedisModuleCommandArg {
                name: arg.name.as_ptr(),
                type_,
                key_spec_index,
                token: arg.token.map_or(ptr::null(), CStr::as_ptr),
                summary: ptr::null(),
                since: ptr::null(),
                flags: flags as c_int,
                deprecated_since: ptr::null(),
                subargs,
                display_text: ptr::null(),
            }
        })
        .collect();
    // SAFETY: an all-zero entry (NULL name) is the table's end, as the server expects.
    table.push(unsafe { std::mem::zeroed() });
    let start = table.as_mut_ptr();
    // Moving the Vec into the arena keeps its heap buffer, and so `start`, valid.
    arena.push(table);
    start
}

/// A qag command.
pub trait Command {
    /// The name clients call, in lower case as Redis lists commands.
    const NAME: &'static CStr;
    const FLAGS: &'static CStr;
    /// As Redis defines arity: positive is exact, negative is a minimum.
    const ARITY: c_int;
    const KEYS: KeyLayout;
    /// Whether the keys are written (else only read).
    const WRITES: bool;
    const SUMMARY: &'static CStr;
    const COMPLEXITY: &'static CStr;
    /// The arguments after the command name, for COMMAND DOCS.
    const ARGS: &'static [Arg];
    /// The module version that added the command, for COMMAND DOCS.
    const SINCE: &'static CStr = c"0.1.0";
    /// Calls, error replies and outcomes, shown in INFO.
    const COUNTERS: &'static CallCounters;
    /// The outcomes the command counts in `COUNTERS`, by index (e.g. `allowed`,
    /// `refused`); none for a command that does not decide.
    const OUTCOMES: &'static [&'static str] = &[];

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError>;
}

impl ArgList for RawArgs {
    fn len(&self) -> usize {
        self.argc
    }

    fn get(&self, index: usize) -> &[u8] {
        // SAFETY: the call's argv strings live for the whole call, longer than `self`.
        unsafe { string_bytes(self.string(index)) }
    }
}

impl RawArgs {
    /// The Redis string of argument `index`; the parser has checked it exists.
    pub fn string(&self, index: usize) -> *mut raw::RedisModuleString {
        assert!(index < self.argc, "argument {index} of {}", self.argc);
        // SAFETY: index < argc, the length of argv.
        unsafe { *self.argv.add(index) }
    }
}

impl Ctx {
    fn reply_row(&self, row: &Row) {
        // SAFETY: plain reply calls on the live context.
        unsafe {
            raw::RedisModule_ReplyWithArray.unwrap()(self.0, row.len as _);
            for value in &row.values[..row.len] {
                match value {
                    Some(v) => raw::RedisModule_ReplyWithLongLong.unwrap()(self.0, *v),
                    None => raw::RedisModule_ReplyWithNull.unwrap()(self.0),
                };
            }
        }
    }

    /// Writes a reply: a command's, or a waiter's answered later.
    pub fn reply(&self, reply: Reply) {
        match reply {
            // SAFETY: a plain reply call on the live context.
            Reply::Integer(value) => unsafe {
                raw::RedisModule_ReplyWithLongLong.unwrap()(self.0, value);
            },
            Reply::Array(row) => self.reply_row(&row),
            Reply::Pair(first, second) => {
                // SAFETY: plain reply calls on the live context.
                unsafe { raw::RedisModule_ReplyWithArray.unwrap()(self.0, 2) };
                self.reply_row(&first);
                match second {
                    Some(row) => self.reply_row(&row),
                    // SAFETY: as above.
                    None => unsafe {
                        raw::RedisModule_ReplyWithNull.unwrap()(self.0);
                    },
                }
            }
            Reply::Held => {}
            Reply::Error(text) => self.reply_error(text),
        }
    }

    /// Answers the server's question of where the keys are (getkeys-api, a counted
    /// layout's only), without running the command.
    fn declare_keys(&self, args: &RawArgs, layout: &KeyLayout) {
        let KeyLayout::Counted { step } = *layout else {
            return;
        };
        let positions = counted_key_positions(args, step, MAX_COUNTED_KEYS);
        for position in positions.into_iter().filter(|&p| p < args.len()) {
            // SAFETY: a position within the call's arguments.
            unsafe { raw::RedisModule_KeyAtPos.unwrap()(self.0, position as c_int) };
        }
    }

    fn reply_error(&self, message: &str) {
        // An error text never holds a NUL; should one appear, say so rather than fail.
        let text = CString::new(message).unwrap_or_else(|_| c"ERR internal error".to_owned());
        // SAFETY: a valid C string.
        unsafe { raw::RedisModule_ReplyWithError.unwrap()(self.0, text.as_ptr()) };
    }
}

/// The function Redis calls for command `C`: parses, runs and replies, and catches any
/// panic so that it becomes an error reply instead of taking the server down.
pub extern "C" fn invoke<C: Command>(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
) -> c_int {
    let ctx = Ctx(ctx);
    let args = RawArgs {
        argv,
        argc: usize::try_from(argc).unwrap_or(0),
    };
    // SAFETY: the API table is filled in at load and never changes.
    if C::KEYS.declared_by_module()
        && unsafe { raw::RedisModule_IsKeysPositionRequest.unwrap()(ctx.0) } != 0
    {
        ctx.declare_keys(&args, &C::KEYS);
        return raw::REDISMODULE_OK as c_int;
    }
    C::COUNTERS.called();
    let result = guarded(|| C::run(&ctx, &args));
    if !matches!(result, Ok(Ok(_))) {
        C::COUNTERS.erred();
    }
    match result {
        Ok(Ok(reply)) => ctx.reply(reply),
        Ok(Err(CommandError::Arg(ArgError::Arity))) => {
            let name = C::NAME.to_string_lossy();
            ctx.reply_error(&format!(
                "ERR wrong number of arguments for '{name}' command"
            ));
        }
        Ok(Err(CommandError::Arg(e))) => ctx.reply_error(&e.to_string()),
        Ok(Err(CommandError::Refused(message))) => ctx.reply_error(message),
        Ok(Err(CommandError::WrongType)) => {
            ctx.reply_error("WRONGTYPE Operation against a key holding the wrong kind of value")
        }
        Err(_) => ctx.reply_error("ERR qag internal error; the command was aborted"),
    }
    raw::REDISMODULE_OK as c_int
}

/// Runs `f`, a panic caught: the one guard between the module's code and the server,
/// for commands and for every callback the server makes (a panic must never unwind into
/// it).
pub fn guarded<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    catch_unwind(AssertUnwindSafe(f))
}

/// The most keys a counted layout declares.
const MAX_COUNTED_KEYS: usize = MAX_SCOPES as usize;

/// The layout of the `RedisModuleCommandInfo` structures this module was built with.
const COMMAND_INFO_VERSION: raw::RedisModuleCommandInfoVersion =
    raw::RedisModuleCommandInfoVersion {
        version: 1,
        sizeof_historyentry: std::mem::size_of::<raw::RedisModuleCommandHistoryEntry>(),
        sizeof_keyspec: std::mem::size_of::<raw::RedisModuleCommandKeySpec>(),
        sizeof_arg: std::mem::size_of::<raw::RedisModuleCommandArg>(),
    };

/// Which optional server features registration could use, for the load log.
#[derive(Default)]
pub struct Features {
    pub command_info: bool,
    pub acl_categories: bool,
    /// Whether the commands are in the ACL category `qag` (Redis 7.4 and later).
    pub qag_category: bool,
}

/// Registers command `C`: its flags and first/last/step keys everywhere, and key specs,
/// arity and docs where the server has `RedisModule_SetCommandInfo` (7.0 and later).
pub fn register<C: Command>(
    ctx: *mut raw::RedisModuleCtx,
    features: &mut Features,
) -> Result<(), String> {
    let name = C::NAME.to_string_lossy();
    stats::show(C::NAME, C::COUNTERS, C::OUTCOMES)?;
    // A counted layout has no fixed range: the command answers key lookups itself.
    let (first, last, step) = match C::KEYS {
        KeyLayout::Single => (1, 1, 1),
        KeyLayout::FirstAndFourth => (1, 4, 3),
        KeyLayout::Counted { .. } => (0, 0, 0),
    };
    let flags = match C::KEYS.declared_by_module() {
        true => CString::new(format!("{} getkeys-api", C::FLAGS.to_string_lossy())),
        false => Ok(C::FLAGS.to_owned()),
    }
    .map_err(|e| format!("flags of {name}: {e}"))?;
    // SAFETY: called from OnLoad with the load context.
    let created = unsafe {
        raw::RedisModule_CreateCommand.unwrap()(
            ctx,
            C::NAME.as_ptr(),
            Some(invoke::<C>),
            flags.as_ptr(),
            first,
            last,
            step,
        )
    };
    if created != raw::REDISMODULE_OK as c_int {
        return Err(format!("could not create command {name}"));
    }
    // SAFETY: as above; these API entries are optional and checked for presence.
    let (Some(get_command), Some(set_info)) = (unsafe { raw::RedisModule_GetCommand }, unsafe {
        raw::RedisModule_SetCommandInfo
    }) else {
        features.qag_category = false;
        return Ok(());
    };
    let command = unsafe { get_command(ctx, C::NAME.as_ptr()) };
    if command.is_null() {
        return Err(format!("could not find command {name} after creating it"));
    }
    // Modules' commands get no ACL categories from their flags; where the server lets a
    // module set them (7.2 and later), put each where its flags say it belongs.
    if let Some(set_categories) = unsafe { raw::RedisModule_SetCommandACLCategories } {
        let (plain, with_qag) = match C::WRITES {
            true => (c"write fast", c"write fast qag"),
            false => (c"read fast", c"read fast qag"),
        };
        // SAFETY: a command of this module and C strings.
        let set = |categories: &CStr| unsafe { set_categories(command, categories.as_ptr()) };
        if features.qag_category && set(with_qag) != raw::REDISMODULE_OK as c_int {
            // The server has no category `qag` after all: grant by name.
            features.qag_category = false;
        }
        if !features.qag_category && set(plain) != raw::REDISMODULE_OK as c_int {
            return Err(format!("could not set the ACL categories of {name}"));
        }
        features.acl_categories = true;
    } else {
        features.qag_category = false;
    }
    let flag_bits = if C::WRITES {
        (KeySpecFlags::READ_WRITE | KeySpecFlags::ACCESS | KeySpecFlags::UPDATE).bits()
    } else {
        (KeySpecFlags::READ_ONLY | KeySpecFlags::ACCESS).bits()
    };
    let incomplete = match C::KEYS {
        KeyLayout::Counted { step } if step > 1 => KeySpecFlags::INCOMPLETE.bits(),
        _ => 0,
    };
    let flags = || KeySpecFlags::from_bits_retain(flag_bits | incomplete);
    let specs = match C::KEYS {
        KeyLayout::Single => vec![(1, FindKeys::new_range(0, 1, 0))],
        // From argument 1, up to 3 further, every third: 1 and 4.
        KeyLayout::FirstAndFourth => vec![(1, FindKeys::new_range(3, 3, 0))],
        // The count at argument 1, the first key right after it. Servers read a count
        // as a number of arguments, not of keys, so with a step the spec finds only
        // some keys: marked incomplete, it sends lookups to the command itself.
        KeyLayout::Counted { step } => vec![(1, FindKeys::new_keys_num(0, 1, step as i32))],
    };
    let mut key_specs = get_redis_key_spec(
        specs
            .into_iter()
            .map(|(pos, find)| KeySpec::new(None, flags(), BeginSearch::new_index(pos), find))
            .collect(),
    );
    let mut arena = Vec::new();
    let info = raw::RedisModuleCommandInfo {
        version: &COMMAND_INFO_VERSION,
        summary: C::SUMMARY.as_ptr(),
        complexity: C::COMPLEXITY.as_ptr(),
        since: C::SINCE.as_ptr(),
        history: ptr::null_mut(),
        tips: ptr::null(),
        arity: C::ARITY,
        key_specs: key_specs.as_mut_ptr(),
        args: raw_args(C::ARGS, &mut arena),
    };
    // SAFETY: `info` and what it points to outlive the call; Redis copies it.
    if unsafe { set_info(command, &info) } != raw::REDISMODULE_OK as c_int {
        return Err(format!("could not set the key specs and docs of {name}"));
    }
    features.command_info = true;
    Ok(())
}
