//! A raw connection for tests that need what a client library hides: several commands
//! in one write (so the server runs them in one turn of its event loop), a reply waited
//! for a bounded time, and a connection reset (RST) instead of a polite close.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// A reply, as RESP2 says it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resp {
    Int(i64),
    Str(Vec<u8>),
    Err(String),
    Nil,
    Array(Vec<Resp>),
}

impl Resp {
    /// The integers of an array reply (nulls as -1), for the families' rows.
    pub fn ints(&self) -> Vec<i64> {
        match self {
            Resp::Array(items) => items
                .iter()
                .map(|item| match item {
                    Resp::Int(n) => *n,
                    _ => -1,
                })
                .collect(),
            Resp::Int(n) => vec![*n],
            _ => Vec::new(),
        }
    }

    pub fn text(&self) -> String {
        match self {
            Resp::Str(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            Resp::Err(text) => text.clone(),
            other => format!("{other:?}"),
        }
    }

    pub fn is_err(&self) -> bool {
        matches!(self, Resp::Err(_))
    }
}

/// Why no reply came.
#[derive(Debug, PartialEq, Eq)]
pub enum NoReply {
    /// None within the time given.
    Late,
    /// The server closed the connection.
    Closed,
}

pub struct RawCon {
    stream: TcpStream,
    buf: Vec<u8>,
}

/// One command's bytes.
pub fn encode(words: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", words.len()).into_bytes();
    for word in words {
        out.extend_from_slice(format!("${}\r\n", word.len()).as_bytes());
        out.extend_from_slice(word.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

impl RawCon {
    pub fn connect(port: u16) -> RawCon {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        RawCon {
            stream,
            buf: Vec::new(),
        }
    }

    /// Writes these commands in one write: the server reads them in one turn.
    pub fn send(&mut self, commands: &[&[&str]]) {
        let bytes: Vec<u8> = commands.iter().flat_map(|words| encode(words)).collect();
        self.stream.write_all(&bytes).expect("write");
    }

    /// The next reply, waited for up to `within` (what has arrived already is read
    /// however little time is left).
    pub fn reply(&mut self, within: Duration) -> Result<Resp, NoReply> {
        let deadline = Instant::now() + within;
        let mut read_once = false;
        loop {
            if let Some((reply, used)) = parse(&self.buf) {
                self.buf.drain(..used);
                return Ok(reply);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() && read_once {
                return Err(NoReply::Late);
            }
            read_once = true;
            self.stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .expect("timeout");
            let mut chunk = [0u8; 16384];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(NoReply::Closed),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => return Err(NoReply::Closed),
            }
        }
    }

    /// One command and its reply (within 10 s).
    pub fn call(&mut self, words: &[&str]) -> Resp {
        self.send(&[words]);
        self.reply(Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("{words:?}: {e:?}"))
    }

    /// A field of an INFO section, as a number.
    pub fn info(&mut self, section: &str, field: &str) -> Option<i64> {
        let text = self.call(&["INFO", section]).text();
        text.lines().find_map(|line| {
            line.strip_prefix(field)?
                .strip_prefix(':')?
                .trim()
                .parse()
                .ok()
        })
    }

    /// The connection's client id.
    pub fn id(&mut self) -> i64 {
        match self.call(&["CLIENT", "ID"]) {
            Resp::Int(id) => id,
            other => panic!("CLIENT ID: {other:?}"),
        }
    }

    /// Closes its side (a FIN): the server reads an end, and what it sent before can
    /// still be read here.
    pub fn half_close(self) -> RawCon {
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        self
    }

    /// Closes with a reset (SO_LINGER 0): the server reads an error, not an end.
    pub fn reset(self) {
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: a valid socket and option.
        unsafe {
            libc::setsockopt(
                self.stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            );
        }
        drop(self.stream);
    }
}

fn line(buf: &[u8]) -> Option<(&[u8], usize)> {
    let end = buf.windows(2).position(|w| w == b"\r\n")?;
    Some((&buf[..end], end + 2))
}

/// A whole reply at the start of `buf`, and its length.
pub fn parse(buf: &[u8]) -> Option<(Resp, usize)> {
    let (&kind, rest) = buf.split_first()?;
    let (text, used) = line(rest)?;
    let text = std::str::from_utf8(text).ok()?;
    let after = 1 + used;
    match kind {
        b'+' => Some((Resp::Str(text.as_bytes().to_vec()), after)),
        b'-' => Some((Resp::Err(text.to_string()), after)),
        b':' => Some((Resp::Int(text.parse().ok()?), after)),
        b'$' => {
            let len: i64 = text.parse().ok()?;
            if len < 0 {
                return Some((Resp::Nil, after));
            }
            let len = len as usize;
            let body = buf.get(after..after + len)?;
            buf.get(after + len..after + len + 2)?;
            Some((Resp::Str(body.to_vec()), after + len + 2))
        }
        b'*' => {
            let count: i64 = text.parse().ok()?;
            if count < 0 {
                return Some((Resp::Nil, after));
            }
            let mut items = Vec::new();
            let mut at = after;
            for _ in 0..count {
                let (item, used) = parse(&buf[at..])?;
                items.push(item);
                at += used;
            }
            Some((Resp::Array(items), at))
        }
        _ => panic!("not RESP: {:?}", String::from_utf8_lossy(buf)),
    }
}
