#!/usr/bin/env python3
"""tests/check_doc_examples.py must catch what it is for: on a small tree of docs, a Python
example that raises, exits non-zero or hangs fails with the doc's file and line (its traceback
in the doc's lines), a `replace:` that matches nothing and an unknown directive fail, `setup:`
and `replace:` are applied, `not run` blocks and docs/RELIABILITY.md are left alone, and a
README C example that is not examples/hello.c fails. Needs no pinmem: the examples here are
plain Python. Run by `make check-docs`; exit status 1 when something goes unseen.

    python3 tests/test_check_doc_examples.py
"""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CHECK = os.path.join(ROOT, "tests", "check_doc_examples.py")

HELLO = "int main(void) { return 0; }\n"
README = f"""# x

```python
print("quickstart")
```

```c
{HELLO}```
"""
GUIDE = """# a guide

<!-- not run: needs a GPU -->
```python
raise SystemExit("a block marked not run ran")
```

<!-- run with: a fragment
setup: size = 1 << 10
replace: 1 << 40 => size
-->
```python
buf = bytearray(1 << 40)
assert len(buf) == 1 << 10
```
"""
RELIABILITY = "# record\n\n```python\nraise SystemExit(1)\n```\n"


def tree(folder, readme=README, guide=GUIDE):
    os.makedirs(os.path.join(folder, "docs"), exist_ok=True)
    os.makedirs(os.path.join(folder, "examples"), exist_ok=True)
    for name, text in (("README.md", readme), ("docs/guide.md", guide),
                       ("docs/RELIABILITY.md", RELIABILITY), ("examples/hello.c", HELLO)):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return folder


def check(root, *args):
    p = subprocess.run([sys.executable, CHECK, *args, root], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def main():
    failures = []

    def expect(name, root, code, *needles, args=()):
        rc, out = check(root, *args)
        missing = [n for n in needles if n not in out]
        if rc != code or missing:
            failures.append(f"{name}: exit {rc} (want {code}), missing {missing}:\n{out}")

    with tempfile.TemporaryDirectory() as tmp:
        def case(name, **docs):
            return tree(os.path.join(tmp, name), **docs)

        expect("a good tree passes", case("good"), 0, "ok   README.md:3", "ok   docs/guide.md:12",
               "skip docs/guide.md:4: needs a GPU", "2 Python examples run, 1 not run, 0 problems")
        broken = GUIDE.replace("assert len(buf) == 1 << 10", "assert len(buf) == 1 << 10\n"
                               "import nothing_by_this_name")
        expect("a block that raises", case("raises", guide=broken), 1,
               "FAIL docs/guide.md:12", "docs/guide.md:12: exit status 1",
               os.path.join(tmp, "raises", "docs", "guide.md") + '", line 15',
               "ModuleNotFoundError")
        expect("a block that exits non-zero", case("exits", readme=README.replace(
            'print("quickstart")', "raise SystemExit(3)")), 1, "README.md:3: exit status 3")
        expect("a block that hangs", case("hangs", readme=README.replace(
            'print("quickstart")', "while True: pass")), 1, "README.md:3: still running after 2",
               args=("--timeout", "2"))
        expect("a stale replace", case("stale", guide=GUIDE.replace("replace: 1 << 40",
                                                                    "replace: 1 << 41")), 1,
               "docs/guide.md:12: 'replace: 1 << 41 => size' matches nothing")
        expect("an unknown directive", case("unknown", guide=GUIDE.replace("not run:", "skip:")),
               1, "docs/guide.md:4: unknown directive 'skip'")
        expect("the README's C example drifts", case("drift", readme=README.replace(
            "return 0;", "return 1;")), 1, "README.md:7: the C example is not examples/hello.c (the file the tests build")

    for f in failures:
        print(f"test_check_doc_examples: {f}", file=sys.stderr)
    print(f"test_check_doc_examples: {7 - len(failures)} of 7 cases caught")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
