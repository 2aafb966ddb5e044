#!/usr/bin/env python3
"""tests/check_doc_examples.py must catch what it is for: on a small tree of docs, a Python
example that raises, exits non-zero or hangs fails with the doc's file and line (its traceback
in the doc's lines), a `replace:` that matches nothing, an unknown directive and a `not run`
without its reason fail, `setup:` and `replace:` are applied, `not run` blocks and
docs/RELIABILITY.md are left alone, and a README C example that is not examples/hello.c fails.
With --c, a C example that does not compile (an error, or a warning: -Werror) fails with the
compiler's message at the doc's line (the block's, or the marker's for a setup line), as does
one that exits non-zero or hangs; `setup:`, `epilogue:` and `replace:` wrap a fragment into a
program. Needs no pinmem: the examples here are plain Python, and plain C against a stand-in
libpinmem.a built here with cc.
Run by `make check-docs`; exit status 1 when something goes unseen.

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
# The C examples, after the Python ones (their lines stay as the cases above name them).
C_GUIDE = """
<!-- not run: needs a GPU -->
```c
int main(void) { return 1; }
```

<!-- run with: a fragment
setup: #include <pinmem.h>
setup: int main(void) {
setup:   int size = 1 << 10;
replace: 1 << 40 => size
epilogue:   return answer == 42 && size == 1 << 10 ? 0 : 2;
epilogue: }
-->
```c
int answer = pm_answer(1 << 40);
```
"""
# The stand-in library: include/pinmem.h declares what libpinmem.a defines.
C_HEADER = "int pm_answer(int size);\n"
C_LIBRARY = "#include <pinmem.h>\nint pm_answer(int size) { return size == 1 << 10 ? 42 : 0; }\n"


def tree(folder, readme=README, guide=GUIDE + C_GUIDE):
    for sub in ("docs", "examples", "include", "build"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    for name, text in (("README.md", readme), ("docs/guide.md", guide),
                       ("docs/RELIABILITY.md", RELIABILITY), ("examples/hello.c", HELLO),
                       ("include/pinmem.h", C_HEADER), ("build/lib.c", C_LIBRARY)):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    build = os.path.join(folder, "build")
    subprocess.run([os.environ.get("CC") or "cc", "-c", "-I", os.path.join(folder, "include"),
                    "-o", "lib.o", "lib.c"], cwd=build, check=True)
    subprocess.run(["ar", "rcs", "libpinmem.a", "lib.o"], cwd=build, check=True)
    return folder


def line_of(text, needle):
    """The 1-based line of the doc text on which needle starts."""
    return text[:text.index(needle)].count("\n") + 1


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
                                                                    "replace: 1 << 41") + C_GUIDE),
               1, "docs/guide.md:12: 'replace: 1 << 41 => size' matches nothing")
        expect("an unknown directive", case("unknown", guide=GUIDE.replace("not run:", "skip:")
                                            + C_GUIDE), 1,
               "docs/guide.md:4: unknown directive 'skip'")
        expect("a not run without its reason", case("noreason", guide=GUIDE.replace(
            "not run: needs a GPU", "not run:") + C_GUIDE), 1,
               "docs/guide.md:4: 'not run' needs its reason")
        expect("the README's C example drifts", case("drift", readme=README.replace(
            "return 0;", "return 1;")), 1, "README.md:7: the C example is not examples/hello.c (the file the tests build")

        # The C examples (--c BUILD: the stand-in library).
        guide = GUIDE + C_GUIDE
        skip, fence = line_of(guide, "```c\nint main"), line_of(guide, "```c\nint answer")

        def c_case(name, guide, *needles, code=1, args=()):
            root = case(name, guide=guide)
            expect(name, root, code, *needles, args=("--c", os.path.join(root, "build"), *args))

        c_case("good C examples pass", guide, "ok   README.md:7", f"ok   docs/guide.md:{fence}",
               f"skip docs/guide.md:{skip}: needs a GPU", "2 C examples run, 1 not run, 0 problems",
               code=0)
        c_case("a C block that does not compile", guide.replace("pm_answer(1", "pm_answr(1"),
               f"FAIL docs/guide.md:{fence}", f"docs/guide.md:{fence}: does not compile",
               f"docs/guide.md:{fence + 1}:14: error: implicit declaration of function", "pm_answr")
        c_case("a C block with a warning", guide.replace("int answer = pm_answer(1 << 40);",
                                                         "int answer = pm_answer(1 << 40), x;"),
               f"docs/guide.md:{fence}: does not compile", f"docs/guide.md:{fence + 1}:",
               "-Werror=unused-variable")
        c_case("a setup line that does not compile", guide.replace("int size = 1 << 10;",
                                                                   "int size = 1 << ten;"),
               f"docs/guide.md:{fence}: does not compile",
               f"docs/guide.md:{line_of(guide, 'setup:   int size')}:26: error:", "ten")
        c_case("a C block that exits non-zero", guide.replace("size == 1 << 10 ?", "size == 1 ?"),
               f"docs/guide.md:{fence}: exit status 2")
        c_case("a C block that hangs", guide.replace("int answer = pm_answer(1 << 40);",
                                                     "int answer = pm_answer(1 << 40);\n"
                                                     "for (;;) {}"),
               f"docs/guide.md:{fence}: still running after 2", args=("--timeout", "2"))
        c_case("a stale replace in a C block", guide.replace("replace: 1 << 40", "replace: 1 << 4"
                                                             "1"),
               f"docs/guide.md:{fence}: 'replace: 1 << 41 => size' matches nothing")

    for f in failures:
        print(f"test_check_doc_examples: {f}", file=sys.stderr)
    print(f"test_check_doc_examples: {14 - len(failures)} of 14 cases caught")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
