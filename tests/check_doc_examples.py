#!/usr/bin/env python3
"""Run the Python examples of the user docs, so that code copied from them works.

Every ```python block of README.md and docs/*.md (docs/RELIABILITY.md aside: a record, not a
guide) runs in a fresh interpreter, in an empty temporary folder, on the host backend
(PINMEM_BACKEND=host: torch sees no GPU there) and with a timeout. An HTML comment right before
the fence, which readers of the rendered page do not see, may change that:

    <!-- not run: WHY -->          the block does not run here (it needs a GPU, vLLM, ...)

    <!-- run with: NOTE            (NOTE, optional: what the stand-ins stand for)
    setup: CODE                    Python run before the block, in its namespace: the names
                                   a fragment takes as given (a model, a file to read)
    replace: OLD => NEW            a literal substitution in the block (device="cuda" -> "cpu"
                                   where torch makes the tensors, big sizes made small); each
    -->                            must match, so that a stale one is caught

A block fails when it raises, exits non-zero or runs out of time; the failure names the doc's
file and the block's line, and the block is compiled under the doc's name with the doc's line
numbers, so its traceback points into the doc. Also README.md's ```c block must be
examples/hello.c, which tests/test_install.sh builds and runs against the installed library.

The interpreter is this one, or --python; the package comes from PYTHONPATH (`make test-python`
sets it to the extension it built). Exit status 1 when an example fails.

    python3 tests/check_doc_examples.py [--python PY] [--timeout S] [--jobs N] [ROOT]
"""
import argparse
import concurrent.futures
import glob
import os
import re
import subprocess
import sys
import tempfile

FENCE = re.compile(r"^```(\w*)\s*$")


class Block:
    def __init__(self, doc, line, lang, code, directive):
        self.doc, self.line, self.lang, self.code = doc, line, lang, code  # line: the fence's
        self.skip, self.setup, self.replace = None, [], []
        if directive is None:
            return
        head, _, body = directive.partition(":")
        if head.strip() == "not run":
            self.skip = body.strip() or "no reason given"
            return
        if head.strip() != "run with":
            raise ValueError(f"{self.where}: unknown directive {head.strip()!r} (not run: "
                             "WHY, or run with: setup/replace lines)")
        items = body.strip().split("\n")
        if items and not re.match(r"(setup|replace):", items[0]):
            items = items[1:]  # a note for the reader of the source: how the block is run
        for item in items:
            kind, _, arg = item.strip().partition(": ")
            if kind == "setup":
                self.setup.append(arg)
            elif kind == "replace" and " => " in arg + " ":
                old, _, new = (arg + " ").partition(" => ")  # "OLD =>" replaces with nothing
                self.replace.append((old, new[:-1]))
            else:
                raise ValueError(f"{self.where}: bad line in 'run with': {item.strip()!r}")

    @property
    def where(self):
        return f"{self.doc}:{self.line}"

    def program(self, root, folder):
        """The script to run, written into folder: the setup, then the block (with its
        replacements) from a file of its own, compiled under the doc's path with the doc's line
        numbers (blank lines before it), so that a traceback shows the doc's lines."""
        code = self.code
        for old, new in self.replace:
            if old not in code:
                raise ValueError(f"{self.where}: 'replace: {old} => {new}' matches nothing in "
                                 "the block")
            code = code.replace(old, new)
        with open(os.path.join(folder, "block.py"), "w") as f:
            f.write("\n" * self.line + code)
        doc = os.path.join(root, self.doc)
        with open(os.path.join(folder, "example.py"), "w") as f:
            f.write("\n".join(self.setup) + "\n"
                    f"exec(compile(open('block.py').read(), {doc!r}, 'exec'))\n")


def blocks(root, doc):
    """The fenced blocks of one doc, each with the HTML comment right before its fence."""
    with open(os.path.join(root, doc), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        directive = None
        if i and lines[i - 1].rstrip().endswith("-->"):
            start = i - 1
            while start >= 0 and "<!--" not in lines[start]:
                start -= 1
            text = "\n".join(lines[start:i])
            directive = text[text.index("<!--") + 4:text.rindex("-->")].strip()
        out.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n", directive))
        i = end + 1
    return out


def run(root, block, python, timeout):
    """None when the block ran, else what went wrong."""
    # The block runs in a folder of its own: PYTHONPATH's relative entries are the caller's.
    path = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join(os.path.abspath(p) if p else p for p in path.split(os.pathsep))
    env = dict(os.environ, PINMEM_BACKEND="host", PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=path)
    with tempfile.TemporaryDirectory(prefix="doc-example-") as cwd:
        try:
            block.program(root, cwd)
        except ValueError as e:
            return str(e)
        try:
            p = subprocess.run([python, "example.py"], cwd=cwd, env=env, capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"") + (e.stderr or b"")
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            return f"{block.where}: still running after {timeout} s\n{tail(out)}"
    if p.returncode != 0:
        return f"{block.where}: exit status {p.returncode}\n{tail(p.stdout + p.stderr)}"
    return None


def tail(text, lines=25):
    return "\n".join("    " + line for line in text.rstrip().split("\n")[-lines:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", nargs="?",
                    default=os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--timeout", type=float, default=90)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()

    docs = ["README.md"] + sorted(
        os.path.relpath(p, args.root) for p in glob.glob(os.path.join(args.root, "docs", "*.md"))
        if os.path.basename(p) != "RELIABILITY.md")
    with open(os.path.join(args.root, "examples", "hello.c"), encoding="utf-8") as f:
        hello = f.read()
    bad, todo, skipped = [], [], []
    for doc in docs:
        try:
            found = blocks(args.root, doc)
        except ValueError as e:
            bad.append(str(e))
            continue
        for b in found:
            if b.lang == "python":
                (skipped if b.skip else todo).append(b)
            elif b.lang == "c" and doc == "README.md" and b.code != hello:
                bad.append(f"{b.where}: the C example is not examples/hello.c (the file the "
                           "tests build and run): make them the same")

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = pool.map(lambda b: run(args.root, b, args.python, args.timeout), todo)
        for b, err in zip(todo, results):
            print(f"{'FAIL' if err else 'ok  '} {b.where}")
            if err:
                bad.append(err)
    for b in skipped:
        print(f"skip {b.where}: {b.skip}")
    for problem in bad:
        print(problem, file=sys.stderr)
    print(f"check_doc_examples: {len(todo)} Python examples run, {len(skipped)} not run, "
          f"{len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
