#!/usr/bin/env python3
"""Instructions per call, counted by callgrind on the whole server (scripts/instructions.sh).

For each server given (name=path), starts it on a free loopback port under
`valgrind --tool=callgrind --instr-atstart=no` with qag (and redis-cell, if given)
loaded, and for every row of ROWS below:
  FLUSHALL; warm 100,000 keys with the row's own warm command (uninstrumented);
  wait until the keyspace's hash table has finished rehashing;
  (the bucket rows: measured within KEPT_WITHIN of the warm-up, or with every key's
  expiry moved back first: see MOVED);
  callgrind_control -i on; send the row's 20,000 calls, pipelined (redis-cli --pipe),
  on 20,000 distinct random warmed keys (or 20,000 new keys for the "creating" rows);
  callgrind_control -i off; callgrind_control -d (a dump of that window only);
  instructions per call = (the dump's total - serverCron's inclusive cost) / calls.
The calls are written once as RESP files from a fixed random seed, so every run sends
the same bytes. Python 3 standard library only; writes a CSV and prints nothing else
but progress (scripts/instructions-table.py makes the tables).
"""
import csv
import os
import random
import re
import socket
import subprocess
import sys
import time

WARM = 100_000
CALLS = 20_000
SEED = 22
STAMP = "1700000000.123456"  # a bucket's ts as the script writes it
ZONE = ["PER", "month", "TZ", "Europe/Berlin"]
BIG = str(2**62)
# A bucket's expiry moves only when the call's refill is past it (bucket::expiry_after_call):
# for period 60 at most once in 15 s. Its "existing" rows are the common case, keys called
# within that slack of their last move: measured right after the warm-up, within
# KEPT_WITHIN seconds of it (else the script warns). Its "existing, expiry moved" rows
# are a bucket called less often than that, every call moving the expiry: the warm-up
# sets each key's expiry MOVED ms ahead, before its refill, so that every call moves it.
KEPT_WITHIN = 12.0
MOVED = 30_000
EXPIRY_MOVED = "existing, expiry moved"
BUCKETS = {"QAG.TAKE", "QAG.TAKE ID", "QAG.TAKE2", "QAG.REFUND"}


def resp(*words):
    out = [b"*%d\r\n" % len(words)]
    for w in words:
        b = w if isinstance(w, bytes) else str(w).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


# A row: (name, family, kind, floor of, warm(k) -> [commands], call(k, i) -> [commands]).
# kind "existing" (or EXPIRY_MOVED): call on a random warmed key k; "creating": call i on a
# key never used.
# Each command is a list of words; a call may be several commands (one row's "call").
def take(key):
    return [["QAG.TAKE", key, 60, 60]]


def moved(key):
    return [["PEXPIRE", key, MOVED]]


def hset(key):
    return [["HSET", key, "tokens", 59, "ts", STAMP]]


def lease(key, ident):
    return [["QAG.LEASE", key, 1_000_000, 3_600_000, ident]]


def throttle(cmd, key):
    return [[cmd, key, 60, 60, 3600, 1]]


def window_keys(k):
    return ["w:{%d}:org" % k, "w:{%d}:team" % k, "w:{%d}:key" % k]


def admit(k):
    words = ["QAG.ADMIT", 3]
    for key in window_keys(k):
        words += [key, BIG, BIG]
    return [words + ["WINDOW", 3600]]


def reserve(k, ident):
    return [admit(k)[0] + ["RESERVE", 100, "ID", ident]]


def record(k):
    return [["QAG.RECORD", 3] + window_keys(k) + [120, "WINDOW", 3600]]


# A spend call as the clients send it by default (issue 37): the limiter's own id (16 hex
# characters made once a process, a counter), remembered KEEP 10 seconds; the key already
# remembers one id, its warm call's (remembered ID-SECONDS: none is forgotten mid-row).
def own_id(i):
    return "9f86d081884c7d65-%d" % i


def quota_add_kept(k, i):
    return [["QAG.QUOTA.ADD", "q:%d" % k] + ZONE + ["CALLS", 1, "ROWS", 0, "ID", own_id(i), "KEEP", 10]]


# The family scripts' rows: each call as its module row's, on the same keys.
SCRIPTS = {
    "token_bucket.lua": ["token_bucket.lua"],
    # As the clients send it for a call with a request id.
    "token_bucket_ids.lua": ["request_ids.lua", "bucket_ids.lua", "token_bucket.lua"],
    "lease.lua": ["lease.lua"],
    "quota.lua": ["request_ids.lua", "quota.lua"],
    "window.lua": ["request_ids.lua", "window.lua"],
}


def month_period(now):
    """lua/quota.lua's period arguments for ZONE's month at `now` (as the clients give
    them): label, start and end, the next month's label and end."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    zone = ZoneInfo(ZONE[3])

    def month(year, m):
        first = datetime(year, m, 1, tzinfo=zone)
        after = datetime(year + m // 12, m % 12 + 1, 1, tzinfo=zone)
        return "%04d-%02d" % (year, m), int(first.timestamp()), int(after.timestamp())

    local = datetime.fromtimestamp(now, zone)
    label, start, end = month(local.year, local.month)
    following = month(local.year + local.month // 12, local.month % 12 + 1)
    return [label, start, end, following[0], following[2]]


def script_admit(shas, k):
    words = ["EVALSHA", shas["window.lua"], 3] + window_keys(k) + ["admit", 3600]
    return words + [BIG, BIG] * 3


def script_rows(shas):
    lease_sha, quota_sha = shas["lease.lua"], shas["quota.lua"]
    period = month_period(time.time())

    def script_lease(key, ident):
        return [["EVALSHA", lease_sha, 1, key, "acquire", 1_000_000, 3_600_000, ident]]

    def quota(k, op, count):
        return [["EVALSHA", quota_sha, 1, "q:%d" % k, op] + period + [count, "", "", ""]]

    def pair(k):
        keys = ["b:{%d}:ip" % k, "b:{%d}:key" % k]
        return [["EVALSHA", shas["token_bucket.lua"], 2] + keys + [600, 60, 60, 60, 1]]

    def take_with_id(k, ident):
        return [["EVALSHA", shas["token_bucket_ids.lua"], 1, "b:%d" % k, 60, 60, 1, ident, ""]]

    return [
        ("EVALSHA token_bucket.lua (2 keys)", "HSET (2 fields) × 2", "existing", pair,
         lambda k, i: pair(k)),
        # The key already remembers an id (its warm call's), as QAG.TAKE ID's row.
        ("EVALSHA token_bucket.lua ID", "HSET (2 fields)", "existing",
         lambda k: take_with_id(k, "w"), lambda k, i: take_with_id(k, "r%d" % i)),
        ("EVALSHA lease.lua acquire + release", "ZADD + ZREMRANGEBYSCORE + ZREM", "existing",
         lambda k: script_lease("l:%d" % k, "w"),
         lambda k, i: script_lease("l:%d" % k, "r%d" % i) +
         [["EVALSHA", lease_sha, 1, "l:%d" % k, "release", "r%d" % i]]),
        ("EVALSHA lease.lua renew", "ZADD XX", "existing", lambda k: script_lease("l:%d" % k, "w"),
         lambda k, i: [["EVALSHA", lease_sha, 1, "l:%d" % k, "renew", "w", 3_600_000]]),
        ("EVALSHA quota.lua check", "HMGET (2 fields)", "existing",
         lambda k: quota(k, "add", 1), lambda k, i: quota(k, "check", BIG)),
        ("EVALSHA quota.lua add", "HINCRBY", "existing",
         lambda k: quota(k, "add", 1), lambda k, i: quota(k, "add", 1)),
        ("EVALSHA window.lua admit (3 scopes)", "HINCRBY × 3", "existing",
         lambda k: [script_admit(shas, k) + [0, "", "", ""]],
         lambda k, i: [script_admit(shas, k) + [0, "", "", ""]]),
        ("EVALSHA window.lua admit RESERVE (3 scopes)", "HINCRBY × 3", "existing",
         lambda k: [script_admit(shas, k) + [100, "", "w", ""]],
         lambda k, i: [script_admit(shas, k) + [100, "", "r%d" % i, ""]]),
        ("EVALSHA window.lua record (3 scopes)", "HINCRBY × 3", "existing",
         lambda k: [script_admit(shas, k) + [0, "", "", ""]],
         lambda k, i: [["EVALSHA", shas["window.lua"], 3] + window_keys(k) +
                       ["record", 3600, 120, "", "", ""]]),
    ]


def rows(shas, cell):
    sha = shas["token_bucket.lua"]
    r = [
        # name, family, kind, warm, call
        ("HSET (2 fields)", "floor", "existing", lambda k: hset("h:%d" % k), lambda k, i: hset("h:%d" % k)),
        ("HSET (2 fields)", "floor", "creating", lambda k: hset("h:%d" % k), lambda k, i: hset("h:new:%d" % i)),
        ("HMGET (2 fields)", "floor", "existing", lambda k: hset("h:%d" % k),
         lambda k, i: [["HMGET", "h:%d" % k, "tokens", "ts"]]),
        ("HSET (2 fields) × 2", "floor", "existing",
         lambda k: hset("h:{%d}:ip" % k) + hset("h:{%d}:key" % k),
         lambda k, i: hset("h:{%d}:ip" % k) + hset("h:{%d}:key" % k)),
        ("HINCRBY", "floor", "existing", lambda k: [["HINCRBY", "c:%d" % k, "calls", 1]],
         lambda k, i: [["HINCRBY", "c:%d" % k, "calls", 1]]),
        ("HINCRBY × 3", "floor", "existing",
         lambda k: [["HINCRBY", key, "req", 1] for key in window_keys(k)],
         lambda k, i: [["HINCRBY", key, "req", 1] for key in window_keys(k)]),
        ("ZADD + ZREMRANGEBYSCORE + ZREM", "floor", "existing",
         lambda k: [["ZADD", "z:%d" % k, 4_000_000_000_000, "w"]],
         lambda k, i: [["ZADD", "z:%d" % k, 4_000_000_000_000, "r%d" % i],
                       ["ZREMRANGEBYSCORE", "z:%d" % k, "-inf", 1_700_000_000_000],
                       ["ZREM", "z:%d" % k, "r%d" % i]]),
        ("ZADD XX", "floor", "existing", lambda k: [["ZADD", "z:%d" % k, 4_000_000_000_000, "w"]],
         lambda k, i: [["ZADD", "z:%d" % k, "XX", 4_000_000_000_000 + i, "w"]]),
        ("SET PX", "floor", "existing", lambda k: [["SET", "s:%d" % k, "1700000000123456789", "PX", 3_600_000]],
         lambda k, i: [["SET", "s:%d" % k, "1700000000123456789", "PX", 3_600_000]]),
        ("SET PX", "floor", "creating", lambda k: [["SET", "s:%d" % k, "1700000000123456789", "PX", 3_600_000]],
         lambda k, i: [["SET", "s:new:%d" % i, "1700000000123456789", "PX", 3_600_000]]),
        ("GET", "floor", "existing", lambda k: [["SET", "s:%d" % k, "1700000000123456789", "PX", 3_600_000]],
         lambda k, i: [["GET", "s:%d" % k]]),
        ("QAG.TAKE", "HSET (2 fields)", "existing", lambda k: take("b:%d" % k), lambda k, i: take("b:%d" % k)),
        ("QAG.TAKE", "HSET (2 fields)", EXPIRY_MOVED, lambda k: take("b:%d" % k) + moved("b:%d" % k),
         lambda k, i: take("b:%d" % k)),
        ("QAG.TAKE", "HSET (2 fields)", "creating", lambda k: take("b:%d" % k), lambda k, i: take("b:new:%d" % i)),
        # With a request id: the key already remembers one (its warm call's).
        ("QAG.TAKE ID", "HSET (2 fields)", "existing", lambda k: [take("b:%d" % k)[0] + ["ID", "w"]],
         lambda k, i: [take("b:%d" % k)[0] + ["ID", "r%d" % i]]),
        ("QAG.TAKE2", "HSET (2 fields) × 2", "existing",
         lambda k: [["QAG.TAKE2", "b:{%d}:ip" % k, 600, 60, "b:{%d}:key" % k, 60, 60]],
         lambda k, i: [["QAG.TAKE2", "b:{%d}:ip" % k, 600, 60, "b:{%d}:key" % k, 60, 60]]),
        ("QAG.TAKE2", "HSET (2 fields) × 2", EXPIRY_MOVED,
         lambda k: [["QAG.TAKE2", "b:{%d}:ip" % k, 600, 60, "b:{%d}:key" % k, 60, 60]] +
         moved("b:{%d}:ip" % k) + moved("b:{%d}:key" % k),
         lambda k, i: [["QAG.TAKE2", "b:{%d}:ip" % k, 600, 60, "b:{%d}:key" % k, 60, 60]]),
        ("QAG.PEEK", "HMGET (2 fields)", "existing", lambda k: take("b:%d" % k),
         lambda k, i: [["QAG.PEEK", "b:%d" % k, 60, 60]]),
        ("QAG.REFUND", "HSET (2 fields)", "existing", lambda k: take("b:%d" % k),
         lambda k, i: [["QAG.REFUND", "b:%d" % k, 60, 60, 1]]),
        ("QAG.REFUND", "HSET (2 fields)", EXPIRY_MOVED, lambda k: take("b:%d" % k) + moved("b:%d" % k),
         lambda k, i: [["QAG.REFUND", "b:%d" % k, 60, 60, 1]]),
        ("EVALSHA token_bucket.lua", "HSET (2 fields)", "existing",
         lambda k: [["EVALSHA", sha, 1, "b:%d" % k, 60, 60]],
         lambda k, i: [["EVALSHA", sha, 1, "b:%d" % k, 60, 60]]),
        ("QAG.LEASE + QAG.RELEASE", "ZADD + ZREMRANGEBYSCORE + ZREM", "existing",
         lambda k: lease("l:%d" % k, "w"),
         lambda k, i: lease("l:%d" % k, "r%d" % i) + [["QAG.RELEASE", "l:%d" % k, "r%d" % i]]),
        ("QAG.RENEW", "ZADD XX", "existing", lambda k: lease("l:%d" % k, "w"),
         lambda k, i: [["QAG.RENEW", "l:%d" % k, "w", 3_600_000]]),
        ("QAG.QUOTA", "HMGET (2 fields)", "existing",
         lambda k: [["QAG.QUOTA.ADD", "q:%d" % k] + ZONE + ["CALLS", 1]],
         lambda k, i: [["QAG.QUOTA", "q:%d" % k] + ZONE + ["CALLS", BIG]]),
        ("QAG.QUOTA.ADD", "HINCRBY", "existing",
         lambda k: [["QAG.QUOTA.ADD", "q:%d" % k] + ZONE + ["CALLS", 1]],
         lambda k, i: [["QAG.QUOTA.ADD", "q:%d" % k] + ZONE + ["CALLS", 1]]),
        # What QAG.QUOTA.ADD is from either client: CALLS and ROWS, the limiter's own id, KEEP.
        ("QAG.QUOTA.ADD ID KEEP", "HINCRBY", "existing",
         lambda k: [["QAG.QUOTA.ADD", "q:%d" % k] + ZONE + ["CALLS", 1, "ROWS", 0, "ID", "w"]],
         quota_add_kept),
        ("QAG.ADMIT (3 scopes)", "HINCRBY × 3", "existing", lambda k: admit(k), lambda k, i: admit(k)),
        ("QAG.ADMIT RESERVE (3 scopes)", "HINCRBY × 3", "existing", lambda k: reserve(k, "w"),
         lambda k, i: reserve(k, "r%d" % i)),
        ("QAG.RECORD (3 scopes)", "HINCRBY × 3", "existing", lambda k: admit(k), lambda k, i: record(k)),
        # What a record is from either client (an id the limiter's, KEEP 10).
        ("QAG.RECORD ID KEEP (3 scopes)", "HINCRBY × 3", "existing",
         lambda k: admit(k) + [record(k)[0] + ["ID", "w"]],
         lambda k, i: [record(k)[0] + ["ID", own_id(i), "KEEP", 10]]),
        ("QAG.THROTTLE", "SET PX", "existing", lambda k: throttle("QAG.THROTTLE", "t:%d" % k),
         lambda k, i: throttle("QAG.THROTTLE", "t:%d" % k)),
        ("QAG.THROTTLE", "SET PX", "creating", lambda k: throttle("QAG.THROTTLE", "t:%d" % k),
         lambda k, i: throttle("QAG.THROTTLE", "t:new:%d" % i)),
    ]
    if cell:
        r += [
            ("CL.THROTTLE", "SET PX", "existing", lambda k: throttle("CL.THROTTLE", "t:%d" % k),
             lambda k, i: throttle("CL.THROTTLE", "t:%d" % k)),
            ("CL.THROTTLE", "SET PX", "creating", lambda k: throttle("CL.THROTTLE", "t:%d" % k),
             lambda k, i: throttle("CL.THROTTLE", "t:new:%d" % i)),
        ]
    return r + script_rows(shas)


def write_calls(path, commands):
    with open(path, "wb") as f:
        for c in commands:
            f.write(resp(*c))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, binary, modules, workdir):
        self.port = free_port()
        self.dir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.out = os.path.join(workdir, "callgrind.out")
        args = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=yes",
                "--callgrind-out-file=" + self.out, "--log-file=" + os.path.join(workdir, "valgrind.log"),
                binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", workdir, "--enable-debug-command", "local", "--daemonize", "no",
                "--logfile", os.path.join(workdir, "redis.log")]
        for m in modules:
            args += ["--loadmodule", m]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        for _ in range(600):
            if self.cli("PING", check=False).strip() == "PONG":
                break
            if self.proc.poll() is not None:
                raise SystemExit("server exited; see " + workdir)
            time.sleep(0.1)
        else:
            raise SystemExit("server did not answer; see " + workdir)
        self.dumps = 0

    def cli(self, *words, check=True, db=0):
        r = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), "-n", str(db)] +
                           [str(w) for w in words], capture_output=True, text=True)
        if check and (r.returncode != 0 or r.stdout.startswith("ERR") or "(error)" in r.stdout):
            raise SystemExit("redis-cli %s: %s %s" % (words, r.stdout, r.stderr))
        return r.stdout

    def pipe(self, path):
        with open(path, "rb") as f:
            r = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), "--pipe"],
                               stdin=f, capture_output=True, text=True)
        m = re.search(r"errors: (\d+), replies: (\d+)", r.stdout)
        if r.returncode != 0 or not m or m.group(1) != "0":
            raise SystemExit("redis-cli --pipe %s: %s %s" % (path, r.stdout, r.stderr))
        return int(m.group(2))

    def control(self, *args):
        subprocess.run(["callgrind_control"] + list(args) + [str(self.proc.pid)],
                       check=True, capture_output=True)

    def settle(self):
        """Waits until no hash table of db 0 is rehashing (rehash steps would be counted)."""
        for _ in range(600):
            stats = self.cli("DEBUG", "HTSTATS", 0)
            if "rehashing target" not in stats and "Rehashing" not in stats:
                return
            time.sleep(0.1)
        raise SystemExit("keyspace still rehashing")

    def measure(self, path):
        self.control("-z")
        self.control("-i", "on")
        replies = self.pipe(path)
        self.control("-i", "off")
        self.control("-d")
        self.dumps += 1
        dump = "%s.%d" % (self.out, self.dumps)
        for _ in range(100):
            if os.path.exists(dump):
                break
            time.sleep(0.1)
        return replies, dump

    def stop(self):
        try:
            self.cli("SHUTDOWN", "NOSAVE", check=False)
            self.proc.wait(timeout=120)
        except Exception:
            self.proc.kill()
            self.proc.wait()


def dump_cost(dump):
    """The dump's total instructions and serverCron's inclusive instructions."""
    total = None
    with open(dump) as f:
        for line in f:
            if line.startswith("totals:") or line.startswith("summary:"):
                total = int(line.split()[1])
    if total is None:
        raise SystemExit("no total in " + dump)
    ann = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", dump],
                         capture_output=True, text=True, check=True).stdout
    cron = 0
    for line in ann.splitlines():
        m = re.match(r"\s*([\d,]+)\s.*[: ]serverCron\b", line)
        if m and not line.strip().startswith("--"):
            cron = max(cron, int(m.group(1).replace(",", "")))
    return total, cron


def main():
    out_csv, module = sys.argv[1], os.path.abspath(sys.argv[2])
    cell = os.environ.get("QAG_CELL_MODULE", "")
    cell = os.path.abspath(cell) if cell else ""
    cell_label = os.environ.get("QAG_CELL_LABEL", "redis-cell")
    servers = [a.split("=", 1) for a in sys.argv[3:]]
    only = [s for s in os.environ.get("QAG_INSTR_ONLY", "").split(",") if s]
    work = os.path.join(os.path.dirname(os.path.abspath(out_csv)), "work")
    os.makedirs(work, exist_ok=True)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    import hashlib
    scripts = {}
    for name, parts in SCRIPTS.items():
        text = b""
        for part in parts:
            with open(os.path.join(repo, "lua", part), "rb") as f:
                text += f.read()
        scripts[name] = text
    shas = {name: hashlib.sha1(text).hexdigest() for name, text in scripts.items()}
    table = rows(shas, bool(cell))
    if only:
        table = [r for r in table if r[0] in only]
    # The calls: the same bytes every run.
    rng = random.Random(SEED)
    picks = rng.sample(range(WARM), CALLS)  # distinct keys: each called once
    files = []
    for n, (name, floor, kind, warm, call) in enumerate(table):
        wpath = os.path.join(work, "row%02d.warm" % n)
        cpath = os.path.join(work, "row%02d.calls" % n)
        write_calls(wpath, (c for k in range(WARM) for c in warm(k)))
        if kind != "creating":
            write_calls(cpath, (c for i, k in enumerate(picks) for c in call(k, i)))
        else:
            write_calls(cpath, (c for i in range(CALLS) for c in call(None, i)))
        files.append((wpath, cpath))
    fresh = not os.path.exists(out_csv)
    with open(out_csv, "a", newline="") as f:
        w = csv.writer(f)
        if fresh:
            w.writerow(["server", "version", "command", "floor", "keys", "calls", "instructions",
                        "servercron", "per_call", "cell"])
        for sname, binary in servers:
            modules = [module] + ([cell] if cell else [])
            srv = Server(binary, modules, os.path.join(work, sname))
            try:
                version = re.search(r"redis_version:(\S+)", srv.cli("INFO", "server")).group(1)
                for script in scripts.values():
                    srv.cli("SCRIPT", "LOAD", script.decode())
                srv.cli("CONFIG", "SET", "hz", "10")
                for (name, floor, kind, _, _), (wpath, cpath) in zip(table, files):
                    t0 = time.time()
                    srv.cli("FLUSHALL", "SYNC") if not version.startswith("6") else srv.cli("FLUSHALL")
                    warming = time.time()
                    srv.pipe(wpath)
                    srv.settle()
                    replies, dump = srv.measure(cpath)
                    gap = time.time() - warming
                    if name in BUCKETS and kind == "existing" and gap > KEPT_WITHIN:
                        print("instructions.py: %s %s measured up to %.0f s after its warm-up: "
                              "some calls may have moved their expiry" % (sname, name, gap),
                              file=sys.stderr)
                    total, cron = dump_cost(dump)
                    per = (total - cron) / CALLS
                    w.writerow([sname, version, name, floor, kind, CALLS, total, cron, "%.1f" % per,
                                cell_label if name.startswith("CL.") else ""])
                    f.flush()
                    print("%s %-32s %-9s %9.0f instructions/call (serverCron %.1f%%, %.0f s)" %
                          (sname, name, kind, per, 100.0 * cron / total, time.time() - t0), flush=True)
                    if os.environ.get("QAG_INSTR_KEEP"):
                        keep = os.path.join(work, "%s-%s-%s.callgrind" % (sname, re.sub(r"\W+", "_", name), kind))
                        os.replace(dump, keep)
                    else:
                        os.remove(dump)
            finally:
                srv.stop()


if __name__ == "__main__":
    main()
