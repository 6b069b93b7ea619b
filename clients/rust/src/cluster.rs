//! Redis Cluster, free of I/O: the slot of a key, which node owns a slot (as a
//! `CLUSTER SLOTS` reply says), when to ask again, and the check that a call's keys
//! share a slot, and which argument of a command is its key. The limiter keeps its state
//! per node with it (module presence, back-off, local counts), so one shard's failure
//! changes nothing for keys on others; [`crate::ClusterNodes`] routes each call by the
//! same table, while another cluster connection routes by its own.

use std::time::{Duration, Instant};

use redis::Value;

use crate::error::Error;

pub(crate) const SLOTS: u16 = 16384;
/// The least time between two readings of the slot table.
pub(crate) const REFRESH_EVERY: Duration = Duration::from_millis(500);

/// CRC16 (XMODEM) of the key's hash tag, or of the whole key without one, modulo the
/// slots: Redis Cluster's key slot.
pub(crate) fn slot_of(key: &[u8]) -> u16 {
    let hashed = hash_tag(key).unwrap_or(key);
    let mut crc: u16 = 0;
    for byte in hashed {
        crc ^= u16::from(*byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % SLOTS
}

/// What is between the first `{` and the next `}`, if that is not empty.
fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|byte| *byte == b'{')?;
    let close = key[open + 1..].iter().position(|byte| *byte == b'}')?;
    (close > 0).then(|| &key[open + 1..open + 1 + close])
}

/// The slot every key is in, else [`Error::CrossSlot`] (nothing was sent).
pub(crate) fn common_slot(keys: &[&str]) -> Result<u16, Error> {
    let mut slots = keys.iter().map(|key| slot_of(key.as_bytes()));
    let first = slots.next().unwrap_or(0);
    if slots.all(|slot| slot == first) {
        Ok(first)
    } else {
        Err(Error::CrossSlot(format!(
            "the keys {} are in different cluster slots: give them a common hash tag",
            keys.join(", ")
        )))
    }
}

/// The key a command is routed by: the module's commands and the scripts have it where
/// their syntax puts it (QAG.ADMIT and QAG.RECORD after the number of scopes, EVALSHA
/// after the number of keys); commands of the server itself (CLUSTER SLOTS, SCRIPT
/// LOAD, ASKING) have none.
pub(crate) fn routing_key<'a>(args: &[&'a [u8]]) -> Option<&'a [u8]> {
    let name = args.first()?;
    let is = |other: &str| name.eq_ignore_ascii_case(other.as_bytes());
    if is("QAG.ADMIT") || is("QAG.RECORD") {
        args.get(2).copied()
    } else if is("EVALSHA") || is("EVAL") {
        match args.get(2) {
            Some(numkeys) if *numkeys != b"0" => args.get(3).copied(),
            _ => None,
        }
    } else if [
        "CLUSTER", "SCRIPT", "ASKING", "PING", "INFO", "TIME", "COMMAND",
    ]
    .iter()
    .any(|keyless| is(keyless))
    {
        None
    } else {
        args.get(1).copied()
    }
}

/// One owner per range of slots, from a `CLUSTER SLOTS` reply: `host:port` of each
/// range's primary. None for a reply of another shape.
pub(crate) fn parse_slots(reply: &Value) -> Option<Vec<(u16, u16, String)>> {
    let Value::Array(entries) = reply else {
        return None;
    };
    let mut ranges = Vec::with_capacity(entries.len());
    for entry in entries {
        let Value::Array(fields) = entry else {
            return None;
        };
        let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(primary))) =
            (fields.first(), fields.get(1), fields.get(2))
        else {
            return None;
        };
        let host = match primary.first() {
            Some(Value::BulkString(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
            Some(Value::SimpleString(text)) => text.clone(),
            _ => return None,
        };
        let Some(Value::Int(port)) = primary.get(1) else {
            return None;
        };
        let start = u16::try_from(*start).ok()?;
        let end = u16::try_from(*end).ok()?.min(SLOTS - 1);
        ranges.push((start, end, format!("{host}:{port}")));
    }
    Some(ranges)
}

/// Whether the server behind the connection is a cluster, as far as the limiter knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Not asked yet, or the last question failed.
    Unknown,
    /// A server without cluster support: one node, for good.
    Single,
    Cluster,
}

/// The slot table as this limiter last read it, and when to read it again: first
/// at once, then after a node failed (its replica may have taken over), one reading
/// at a time and at most every [`REFRESH_EVERY`].
#[derive(Debug)]
pub(crate) struct Topology {
    pub(crate) kind: Kind,
    ranges: Vec<(u16, u16, String)>,
    /// Slots a MOVED reply placed elsewhere since the table was read.
    moved: Vec<(u16, String)>,
    stale: bool,
    refreshing: bool,
    last: Option<Instant>,
}

impl Default for Topology {
    fn default() -> Self {
        Topology {
            kind: Kind::Unknown,
            ranges: Vec::new(),
            moved: Vec::new(),
            stale: true,
            refreshing: false,
            last: None,
        }
    }
}

impl Topology {
    /// The primary owning `slot`, if the table has one.
    pub(crate) fn owner(&self, slot: u16) -> Option<&str> {
        let moved = self.moved.iter().rev().find(|(moved, _)| *moved == slot);
        moved.map(|(_, owner)| owner.as_str()).or_else(|| {
            self.ranges
                .iter()
                .find(|(start, end, _)| (*start..=*end).contains(&slot))
                .map(|(_, _, owner)| owner.as_str())
        })
    }

    /// Whether the table (or a MOVED reply since it was read) names `node` a primary.
    pub(crate) fn names(&self, node: &str) -> bool {
        self.ranges.iter().any(|(_, _, owner)| owner == node)
            || self.moved.iter().any(|(_, owner)| owner == node)
    }

    /// Every primary the table names, each once.
    pub(crate) fn primaries(&self) -> Vec<String> {
        let mut primaries: Vec<String> = Vec::new();
        for (_, _, owner) in &self.ranges {
            if !primaries.contains(owner) {
                primaries.push(owner.clone());
            }
        }
        primaries
    }

    /// A MOVED reply: `slot` is served by `node` now; the table is read again when due.
    pub(crate) fn slot_moved(&mut self, slot: u16, node: &str) {
        self.moved.retain(|(moved, _)| *moved != slot);
        // Bounded: a reshard moves slots by the thousand, the next reading has them all.
        if self.moved.len() < usize::from(SLOTS) {
            self.moved.push((slot, node.to_owned()));
        }
        self.stale = true;
    }

    /// The first reading, once: true if it is to run now.
    pub(crate) fn start_first(&mut self) -> bool {
        if self.last.is_some() || self.refreshing {
            return false;
        }
        self.refreshing = true;
        true
    }

    pub(crate) fn node_failed(&mut self) {
        self.stale = true;
    }

    /// True when a reading is to start now (the caller reports how it went).
    pub(crate) fn start_refresh(&mut self, now: Instant) -> bool {
        let due = self
            .last
            .is_none_or(|last| now.duration_since(last) >= REFRESH_EVERY);
        if self.kind == Kind::Single || self.refreshing || !self.stale || !due {
            return false;
        }
        self.refreshing = true;
        true
    }

    pub(crate) fn learned(&mut self, ranges: Vec<(u16, u16, String)>, now: Instant) {
        self.kind = Kind::Cluster;
        self.ranges = ranges;
        self.moved.clear();
        self.stale = false;
        self.refreshing = false;
        self.last = Some(now);
    }

    pub(crate) fn single(&mut self) {
        self.kind = Kind::Single;
        self.refreshing = false;
    }

    pub(crate) fn refresh_failed(&mut self, now: Instant) {
        self.refreshing = false;
        self.last = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_as_redis_computes_them() {
        // CLUSTER KEYSLOT on Redis 7.0.
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"bar"), 5061);
        assert_eq!(slot_of(b"qag:{tenant0}:ip"), slot_of(b"tenant0"));
        assert_eq!(slot_of(b"{}foo"), slot_of(b"{}foo"));
        assert_ne!(slot_of(b"{}foo"), slot_of(b"foo"));
        assert_eq!(slot_of(b"a{b}c{d}"), slot_of(b"b"));
    }

    #[test]
    fn keys_of_two_slots_are_refused() {
        assert!(common_slot(&["qag:{a}:x", "qag:{a}:y"]).is_ok());
        let Err(Error::CrossSlot(why)) = common_slot(&["qag:{a}:x", "qag:{b}:y"]) else {
            panic!("two slots")
        };
        assert!(why.contains("common hash tag"), "{why}");
    }

    #[test]
    fn each_command_is_routed_by_its_key() {
        let key = |words: &[&str]| {
            let args: Vec<&[u8]> = words.iter().map(|word| word.as_bytes()).collect();
            routing_key(&args).map(|key| String::from_utf8_lossy(key).into_owned())
        };
        assert_eq!(key(&["QAG.TAKE", "b", "10", "60"]).as_deref(), Some("b"));
        assert_eq!(
            key(&["qag.take2", "c", "1", "1", "k", "1", "1"]).as_deref(),
            Some("c")
        );
        assert_eq!(
            key(&["QAG.ADMIT", "2", "s1", "10", "0", "s2", "5", "0"]).as_deref(),
            Some("s1")
        );
        assert_eq!(key(&["QAG.RECORD", "1", "s1", "40"]).as_deref(), Some("s1"));
        assert_eq!(
            key(&["EVALSHA", "abc", "1", "b", "10"]).as_deref(),
            Some("b")
        );
        assert_eq!(key(&["EVALSHA", "abc", "0"]), None);
        assert_eq!(key(&["HMGET", "b", "tokens"]).as_deref(), Some("b"));
        assert_eq!(key(&["CLUSTER", "SLOTS"]), None);
        assert_eq!(key(&["SCRIPT", "LOAD", "return 1"]), None);
        assert_eq!(key(&["QAG.ADMIT"]), None);
        assert_eq!(key(&[]), None);
    }

    #[test]
    fn a_moved_slot_is_served_by_its_new_owner_until_the_next_reading() {
        let mut topology = Topology::default();
        let now = Instant::now();
        topology.learned(vec![(0, 16383, "a:1".into())], now);
        topology.slot_moved(7, "b:2");
        assert_eq!(topology.owner(7), Some("b:2"));
        assert_eq!(topology.owner(8), Some("a:1"));
        assert!(topology.start_refresh(now + REFRESH_EVERY), "read again");
        topology.learned(vec![(0, 16383, "a:1".into())], now);
        assert_eq!(topology.owner(7), Some("a:1"));
        assert_eq!(topology.primaries(), vec!["a:1".to_string()]);
    }

    #[test]
    fn a_table_from_cluster_slots() {
        let node = |port: i64| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node(7000),
                node(7003),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(16383), node(7001)]),
        ]);
        let mut topology = Topology::default();
        let now = Instant::now();
        assert!(topology.start_refresh(now));
        assert!(!topology.start_refresh(now), "one reading at a time");
        topology.learned(parse_slots(&reply).expect("a table"), now);
        assert_eq!(topology.owner(0), Some("127.0.0.1:7000"));
        assert_eq!(topology.owner(5461), Some("127.0.0.1:7001"));
        assert!(!topology.start_refresh(now + REFRESH_EVERY), "not stale");
        topology.node_failed();
        assert!(!topology.start_refresh(now), "too soon");
        assert!(topology.start_refresh(now + REFRESH_EVERY));
        assert_eq!(parse_slots(&Value::Int(1)), None);
    }
}
