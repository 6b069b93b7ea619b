#!/usr/bin/env python3
"""Compares two CSVs of scripts/instructions.sh (before, after): instructions per call of
every row on every server and the change in percent, as Markdown, then the largest change.
For a before-and-after of one optimization, or two runs of the same tree (repeatability).
Python 3 standard library only. Usage: instructions-compare.py before.csv after.csv"""
import csv
import sys


def load(path):
    rows = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            label = r["command"] + (" (%s)" % r["cell"] if r.get("cell") else "")
            rows[(r["server"], label, r["keys"])] = float(r["per_call"])
    return rows


def main():
    before, after = load(sys.argv[1]), load(sys.argv[2])
    print("| server | per call | keys | before | after | change |")
    print("|---|---|---|---:|---:|---:|")
    worst = (0.0, None)
    for key in before:
        if key not in after:
            continue
        b, a = before[key], after[key]
        change = 100.0 * (a - b) / b
        if abs(change) >= abs(worst[0]):
            worst = (change, key)
        print("| %s | %s | %s | %s | %s | %+.2f %% |" % (
            key[0], key[1], key[2], "{:,.0f}".format(b), "{:,.0f}".format(a), change))
    if worst[1]:
        print("\nlargest change: %+.2f %% (%s, %s, %s)" % ((worst[0],) + worst[1]))


if __name__ == "__main__":
    main()
