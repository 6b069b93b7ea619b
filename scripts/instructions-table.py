#!/usr/bin/env python3
"""Reads the CSV of scripts/instructions.py and prints the table of instructions per call
(one column per server) and the ratios issue 22 targets, as Markdown; Python 3 standard
library only. Usage: instructions-table.py instructions.csv [out.md]"""
import csv
import sys


def load(path):
    figures, floors, servers, versions = {}, {}, [], {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            label = r["command"] + (" (%s)" % r["cell"] if r.get("cell") else "")
            key = (label, r["keys"])
            if r["server"] not in servers:
                servers.append(r["server"])
            versions[r["server"]] = r["version"]
            figures.setdefault(key, {})[r["server"]] = float(r["per_call"])
            floors[key] = r["floor"]
    return figures, floors, servers, versions


def main():
    figures, floors, servers, versions = load(sys.argv[1])
    out = []
    out.append("| per call | keys | floor | " + " | ".join(
        "%s (%s)" % (s, versions[s]) for s in servers) + " | " +
        " | ".join("× floor, %s" % s for s in servers) + " |")
    out.append("|---|---|---|" + "---:|" * (2 * len(servers)))

    def floor_of(key):
        name, keys = key
        fl = floors[key]
        if fl == "floor":
            return None
        for k in ((fl, keys), (fl, "existing")):
            if k in figures:
                return k
        return None

    order = sorted(figures, key=lambda k: (floors[k] != "floor", k[0], k[1] != "existing"))
    for key in order:
        fk = floor_of(key)
        cells = ["{:,.0f}".format(figures[key][s]) if s in figures[key] else "–" for s in servers]
        ratios = []
        for s in servers:
            if fk and s in figures[key] and s in figures[fk]:
                ratios.append("%.2f×" % (figures[key][s] / figures[fk][s]))
            else:
                ratios.append("")
        out.append("| %s | %s | %s | %s | %s |" % (
            key[0], key[1], floors[key] if fk else "", " | ".join(cells), " | ".join(ratios)))

    def ratio(a, b, s):
        if a in figures and b in figures and s in figures[a] and s in figures[b]:
            return figures[a][s] / figures[b][s]
        return None

    targets = []
    cells = sorted({k[0] for k in figures if k[0].startswith("CL.THROTTLE")})
    for cell in cells:
        for keys, qag, goal in (("existing", "QAG.TAKE", 0.60), ("creating", "QAG.TAKE", 0.95),
                                ("existing", "QAG.THROTTLE", 0.60), ("creating", "QAG.THROTTLE", 0.75)):
            targets.append(("%s / %s, %s keys" % (qag, cell, keys), (qag, keys), (cell, keys), goal))
    targets.append(("QAG.TAKE / HSET of two fields, existing keys", ("QAG.TAKE", "existing"),
                    ("HSET (2 fields)", "existing"), 2.2))
    for script, module in (("EVALSHA token_bucket.lua", "QAG.TAKE"),
                           ("EVALSHA token_bucket.lua (2 keys)", "QAG.TAKE2"),
                           ("EVALSHA token_bucket.lua ID", "QAG.TAKE ID"),
                           ("EVALSHA lease.lua acquire + release", "QAG.LEASE + QAG.RELEASE"),
                           ("EVALSHA lease.lua renew", "QAG.RENEW"),
                           ("EVALSHA quota.lua check", "QAG.QUOTA"),
                           ("EVALSHA quota.lua add", "QAG.QUOTA.ADD"),
                           ("EVALSHA window.lua admit (3 scopes)", "QAG.ADMIT (3 scopes)"),
                           ("EVALSHA window.lua admit RESERVE (3 scopes)",
                            "QAG.ADMIT RESERVE (3 scopes)"),
                           ("EVALSHA window.lua record (3 scopes)", "QAG.RECORD (3 scopes)")):
        targets.append(("%s / %s, existing keys" % (script, module),
                        (script, "existing"), (module, "existing"), None))
    out.append("")
    out.append("| ratio (instructions per call) | target | " + " | ".join(servers) + " |")
    out.append("|---|---:|" + "---:|" * len(servers))
    for label, a, b, goal in targets:
        vals = [ratio(a, b, s) for s in servers]
        out.append("| %s | %s | %s |" % (label, "≤ %.2f×" % goal if goal else "",
                                         " | ".join("%.2f×" % v if v is not None else "–" for v in vals)))
    text = "\n".join(out) + "\n"
    sys.stdout.write(text)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
