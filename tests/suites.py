#!/usr/bin/env python3
"""What `make test` ran, and what it did not: one record per suite, and the final line.

Each suite's make target records its outcome in a folder (one small file per suite), so the
last line of `make test` names the suites that ran, those that did not and why (no GPU, no
torch), and the checks and tests that were skipped inside the suites that ran, instead of a
bare "all suites passed".

    suites.py reset DIR                    forget the records of an earlier run
    suites.py ran DIR NAME [TEXT]          NAME ran and passed (TEXT: what it ran)
    suites.py not-run DIR NAME WHY         NAME did not run, because WHY
    suites.py ctest DIR NAME BUILD         NAME is the ctest run in BUILD: count its tests, and
                                           print and count its SKIPPED lines (tests/helpers.c)
                                           and the tests CTest reports as not run
    suites.py pytest DIR NAME XML          NAME is the pytest run whose JUnit XML is XML: count
                                           passed and skipped tests, and print each skip reason
    suites.py report DIR                   the final line (exit 1 when no suite was recorded)

Only the suites' own outcomes are counted here: a failing suite stops make before its record.
"""
import collections
import os
import re
import sys
import xml.etree.ElementTree as ET


def write(folder, name, state, text):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
        f.write(f"{state}\t{text}\n")


def ctest(folder, name, build):
    # The newest log of the run: LastTest.log, or LastDynamicAnalysis_<date>.log for memcheck.
    tmp = os.path.join(build, "Testing", "Temporary")
    logs = [os.path.join(tmp, n) for n in os.listdir(tmp)
            if n == "LastTest.log" or re.match(r"LastDynamicAnalysis_.*\.log$", n)]
    log = max(logs, key=os.path.getmtime)
    with open(log, errors="replace") as f:
        lines = f.read().splitlines()
    test, tests, not_run, skips = None, 0, [], []
    for line in lines:
        m = re.match(r"^\d+/\d+ Testing: (\S+)", line)
        if m:
            test = m.group(1)
            tests += 1
            continue
        if line.startswith("SKIPPED: "):
            skips.append(f"{test}: {line[len('SKIPPED: '):]}")
        elif re.match(r"^Test (Skipped|Not Run)", line) or line.startswith("SKIP: "):
            not_run.append(f"{test}: {line}")
    for s in not_run:
        print(f"{name}: test not run: {s}")
    for s in skips:
        print(f"{name}: check skipped: {s}")
    parts = [f"{tests} tests"]
    if not_run:
        parts.append(f"{len(not_run)} not run")
    if skips:
        parts.append(f"{len(skips)} checks skipped")
    write(folder, name, "ran", ", ".join(parts))


def pytest(folder, name, xml):
    root = ET.parse(xml).getroot()
    counts, reasons = collections.Counter(), collections.Counter()
    for case in root.iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            counts["skipped"] += 1
            reasons[skipped.get("message", "").strip() or "no reason given"] += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        else:
            counts["passed"] += 1
    for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"{name}: {n} skipped: {why}")
    parts = [f"{counts['passed']} passed"]
    if counts["skipped"]:
        parts.append(f"{counts['skipped']} skipped")
    if counts["failed"]:
        parts.append(f"{counts['failed']} failed")
    write(folder, name, "ran", ", ".join(parts))


def report(folder):
    ran, not_run = [], []
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for n in names:
        with open(os.path.join(folder, n)) as f:
            state, _, text = f.read().strip().partition("\t")
        item = f"{n} ({text})" if text else n
        (ran if state == "ran" else not_run).append(item)
    if not ran:
        print("make test: no suite recorded a result")
        return 1
    line = "make test: passed: " + "; ".join(ran)
    line += ". Did not run: " + ("; ".join(not_run) if not_run else "none")
    print(line)
    return 0


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, folder, rest = argv[1], argv[2], argv[3:]
    if cmd == "reset":
        if os.path.isdir(folder):
            for n in os.listdir(folder):
                os.remove(os.path.join(folder, n))
        return 0
    if cmd == "ran" and len(rest) in (1, 2):
        write(folder, rest[0], "ran", rest[1] if len(rest) == 2 else "")
    elif cmd == "not-run" and len(rest) == 2:
        write(folder, rest[0], "not-run", rest[1])
    elif cmd == "ctest" and len(rest) == 2:
        ctest(folder, *rest)
    elif cmd == "pytest" and len(rest) == 2:
        pytest(folder, *rest)
    elif cmd == "report" and not rest:
        return report(folder)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
