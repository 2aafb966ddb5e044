#!/usr/bin/env python3
"""Run the Python or the C examples of the user docs, so that code copied from them works.

Every ```python block of README.md and docs/*.md (docs/RELIABILITY.md aside: a record, not a
guide) runs in a fresh interpreter, in an empty temporary folder, on the host backend
(PINMEM_BACKEND=host: torch sees no GPU there) and with a timeout. With --c BUILD, every ```c
block instead is compiled with -std=c11 -Wall -Wextra -Werror against include/ and BUILD's
libpinmem.a, then run the same way (PINMEM_HOST_DEVICES=2: two simulated devices). An HTML
comment right before the fence, which readers of the rendered page do not see, may change that:

    <!-- not run: WHY -->          the block does not run here (it needs a GPU, vLLM, ...)

    <!-- run with: NOTE            (NOTE, optional: what the stand-ins stand for)
    setup: CODE                    code before the block: the names a fragment takes as given
                                   (Python: a model, a file to read, run in the block's
                                   namespace; C: the includes and declarations, and for a
                                   fragment without main, `int main(void) {` and what the
                                   fragment's statements need)
    epilogue: CODE                 code after the block (C: a fragment's `return` and `}`)
    replace: OLD => NEW            a literal substitution in the block (device="cuda" -> "cpu"
                                   where torch makes the tensors, big sizes made small); each
    -->                            must match, so that a stale one is caught

Each setup or epilogue line is one line of code; there may be many, in order. A block fails
when it raises (Python), does not compile (C), exits non-zero or runs out of time; the failure
names the doc's file and the block's line. The code is compiled under the doc's name with the
doc's line numbers (a C program through #line: the marker's lines for setup and epilogue), so a
traceback or a compiler error points into the doc. Also README.md's ```c block must be
examples/hello.c, which tests/test_install.sh builds and runs against the installed library.

The interpreter is this one, or --python; the package comes from PYTHONPATH (`make test-python`
sets it to the extension it built). The C compiler is $CC, else cc; --runner prefixes each
run (`--runner "valgrind --leak-check=full --error-exitcode=97"`). Exit status 1 when an
example fails.

    python3 tests/check_doc_examples.py [--python PY | --c BUILD [--runner CMD]] [--timeout S]
                                        [--jobs N] [ROOT]
"""
import argparse
import concurrent.futures
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile

FENCE = re.compile(r"^```(\w*)\s*$")


class Block:
    def __init__(self, doc, line, lang, code, directive, directive_line=0):
        self.doc, self.line, self.lang, self.code = doc, line, lang, code  # line: the fence's
        # setup and epilogue: (the marker's line in the doc, the code's column on it, the code)
        self.skip, self.setup, self.epilogue, self.replace = None, [], [], []
        if directive is None:
            return
        head, _, body = directive.partition(":")
        if head.strip() == "not run":
            # A block left out says why: the reader of the source must be able to tell an
            # example that cannot run here from one nobody checked.
            if not body.strip():
                raise ValueError(f"{self.where}: 'not run' needs its reason (not run: WHY)")
            self.skip = body.strip()
            return
        if head.strip() != "run with":
            raise ValueError(f"{self.where}: unknown directive {head.strip()!r} (not run: "
                             "WHY, or run with: setup/replace lines)")
        # Each item with its line in the doc (directive_line: the marker's first line).
        items = [(directive_line + i, item) for i, item in enumerate(body.split("\n"))]
        items = [(n, item) for n, item in items if item.strip()]
        if items and not re.match(r"(setup|epilogue|replace):", items[0][1].strip()):
            items = items[1:]  # a note for the reader of the source: how the block is run
        for n, item in items:
            kind, _, arg = item.strip().partition(": ")
            if kind in ("setup", "epilogue"):
                # The code's column in the doc: a C compiler's messages name it.
                column = len(item) - len(item.lstrip()) + len(kind) + 2
                getattr(self, kind).append((n, column, arg))
            elif kind == "replace" and " => " in arg + " ":
                old, _, new = (arg + " ").partition(" => ")  # "OLD =>" replaces with nothing
                self.replace.append((old, new[:-1]))
            else:
                raise ValueError(f"{self.where}: bad line in 'run with': {item.strip()!r}")

    @property
    def where(self):
        return f"{self.doc}:{self.line}"

    def replaced(self):
        """The block's code with its replacements made."""
        code = self.code
        for old, new in self.replace:
            if old not in code:
                raise ValueError(f"{self.where}: 'replace: {old} => {new}' matches nothing in "
                                 "the block")
            code = code.replace(old, new)
        return code

    def program(self, root, folder):
        """The script to run, written into folder: the setup, then the block (with its
        replacements) from a file of its own, compiled under the doc's path with the doc's line
        numbers (blank lines before it), so that a traceback shows the doc's lines, then the
        epilogue."""
        with open(os.path.join(folder, "block.py"), "w") as f:
            f.write("\n" * self.line + self.replaced())
        doc = os.path.join(root, self.doc)
        with open(os.path.join(folder, "example.py"), "w") as f:
            f.write("".join(code + "\n" for _, _, code in self.setup) +
                    f"exec(compile(open('block.py').read(), {doc!r}, 'exec'))\n" +
                    "".join(code + "\n" for _, _, code in self.epilogue))

    def c_program(self):
        """The C source: the setup, the block and the epilogue, each line under the doc's name
        and line (#line) and a marker's line at its column, so that the compiler's messages
        point into the doc."""
        def at(line, column, code):
            return f'#line {line} "{self.doc}"\n{" " * column}{code}\n'
        return ("".join(at(*item) for item in self.setup) +
                at(self.line + 1, 0, self.replaced().rstrip("\n")) +
                "".join(at(*item) for item in self.epilogue))


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
        directive, start = None, 0
        if i and lines[i - 1].rstrip().endswith("-->"):
            start = i - 1
            while start >= 0 and "<!--" not in lines[start]:
                start -= 1
            text = "\n".join(lines[start:i])
            raw = text[text.index("<!--") + 4:text.rindex("-->")]
            directive = raw.strip()
            start += raw[:len(raw) - len(raw.lstrip())].count("\n")  # the directive's first line
        out.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n", directive,
                         start + 1))
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
        return execute(block, [python, "example.py"], cwd, env, timeout)


def run_c(root, block, build, timeout, runner):
    """None when the C block compiled and ran, else what went wrong."""
    env = dict(os.environ, PINMEM_BACKEND="host", PINMEM_HOST_DEVICES="2")
    with tempfile.TemporaryDirectory(prefix="doc-example-") as cwd:
        try:
            source = block.c_program()
        except ValueError as e:
            return str(e)
        with open(os.path.join(cwd, "example.c"), "w") as f:
            f.write(source)
        # As a user links the static library (tests/test_install.sh): its dependencies follow.
        cc = shlex.split(os.environ.get("CC") or "cc") + [
            "-std=c11", "-Wall", "-Wextra", "-Werror", "-g",
            "-I", os.path.join(root, "include"), "-o", "example", "example.c",
            os.path.join(os.path.abspath(build), "libpinmem.a"), "-pthread", "-lm", "-ldl"]
        p = subprocess.run(cc, cwd=cwd, capture_output=True, text=True)
        if p.returncode != 0:
            return (f"{block.where}: does not compile ({' '.join(cc[1:5])})\n"
                    f"{tail(p.stdout + p.stderr)}")
        return execute(block, shlex.split(runner) + ["./example"], cwd, env, timeout)


def execute(block, argv, cwd, env, timeout):
    """None when argv exited with status 0 in time, else what went wrong."""
    try:
        p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=timeout)
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
    ap.add_argument("--c", metavar="BUILD",
                    help="compile and run the C examples against BUILD/libpinmem.a instead")
    ap.add_argument("--runner", default="", help="a command that runs each C example")
    ap.add_argument("--timeout", type=float, default=90)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    lang = "c" if args.c else "python"
    if args.c and not os.path.isfile(os.path.join(args.c, "libpinmem.a")):
        ap.error(f"{args.c}/libpinmem.a: no such file (build the pinmem_static target first)")

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
            if b.lang == lang:
                (skipped if b.skip else todo).append(b)
            if b.lang == "c" and doc == "README.md" and b.code != hello:
                bad.append(f"{b.where}: the C example is not examples/hello.c (the file the "
                           "tests build and run): make them the same")

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        if args.c:
            results = pool.map(lambda b: run_c(args.root, b, args.c, args.timeout, args.runner),
                               todo)
        else:
            results = pool.map(lambda b: run(args.root, b, args.python, args.timeout), todo)
        for b, err in zip(todo, results):
            print(f"{'FAIL' if err else 'ok  '} {b.where}")
            if err:
                bad.append(err)
    for b in skipped:
        print(f"skip {b.where}: {b.skip}")
    for problem in bad:
        print(problem, file=sys.stderr)
    print(f"check_doc_examples: {len(todo)} {'C' if args.c else 'Python'} examples run, "
          f"{len(skipped)} not run, "
          f"{len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
