#!/usr/bin/env python3
"""tests/check_docs.py must catch what it is for: on a copy of the docs with one thing changed
(an option's default in the table or in the sources, a default quoted in prose, an option that
does not exist, a long line), it reports that change, and nothing new on the copy left alone.
Run by `make check-docs`; exit status 1 when a change goes unseen.

    python3 tests/test_check_docs.py
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CHECK = os.path.join(ROOT, "tests", "check_docs.py")


def copy_tree(dst):
    """The repository as check_docs reads it: the docs and the option table copied (to be
    edited), everything else linked."""
    for name in os.listdir(ROOT):
        if name.startswith(".") or name.startswith("build"):
            continue
        src = os.path.join(ROOT, name)
        if name in ("README.md", "docs"):
            (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(dst, name))
        elif name == "src":
            os.makedirs(os.path.join(dst, "src", "core"))
            for sub in os.listdir(src):
                if sub != "core":
                    os.symlink(os.path.join(src, sub), os.path.join(dst, "src", sub))
            for f in os.listdir(os.path.join(src, "core")):
                shutil.copy(os.path.join(src, "core", f), os.path.join(dst, "src", "core", f))
        else:
            os.symlink(src, os.path.join(dst, name))


def problems(root):
    out = subprocess.run([sys.executable, CHECK, root], capture_output=True, text=True).stdout
    return {line for line in out.splitlines() if not line.startswith("check_docs:")}


def edit(path, old, new, count=1):
    text = open(path, encoding="utf-8").read()
    assert old in text, f"{path}: {old!r} not found (the test needs updating)"
    open(path, "w", encoding="utf-8").write(text.replace(old, new, count))


def append(path, text):
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n" + text + "\n")


CASES = [
    # (what, change(root), a regex one of the new problems must match)
    ("a default changed in the option table (src/core/config.c)",
     lambda r: edit(os.path.join(r, "src/core/config.c"),
                    '"file_chunk", "PINMEM_FILE_CHUNK", "2M"', '"file_chunk", "PINMEM_FILE_CHUNK", "4M"'),
     r"docs/options.md:\d+: option `file_chunk` reads `PINMEM_FILE_CHUNK` `2M`; the option table "
     r"has `PINMEM_FILE_CHUNK` `4M`"),
    ("a default changed in docs/options.md",
     lambda r: edit(os.path.join(r, "docs/options.md"), "| `loader_prefetch` | `PINMEM_LOADER_PREFETCH` | `4` |",
                    "| `loader_prefetch` | `PINMEM_LOADER_PREFETCH` | `8` |"),
     r"docs/options.md:\d+: option `loader_prefetch` reads .* `8`; the option table has .* `4`"),
    ("a stale default quoted in prose",
     lambda r: append(os.path.join(r, "docs/loader.md"),
                      "Each slot goes to the device in parts (option `loader_piece`, default 8 MiB)."),
     r"docs/loader.md:\d+: quotes the default of `loader_piece` as 8 MiB; the option table says 4M"),
    ("a stale value stated as the option's",
     lambda r: append(os.path.join(r, "docs/files.md"), "The sweep's best was 8 MiB slots, so\n"
                      "`file_chunk` is 8 MiB."),
     r"docs/files.md:\d+: quotes the default of `file_chunk` as 8 MiB"),
    ("a stale default through the environment variable",
     lambda r: append(os.path.join(r, "README.md"), "`PINMEM_COPY_CHUNK` (default 8M) sets the chunk."),
     r"README.md:\d+: quotes the default of `copy_chunk` as 8M; the option table says 4M"),
    ("the default written as name=value",
     lambda r: append(os.path.join(r, "docs/numa.md"), "With `numa_threads=0` (the default), nothing moves."),
     r"docs/numa.md:\d+: quotes the default of `numa_threads` as 0"),
    ("an option that does not exist",
     lambda r: append(os.path.join(r, "docs/files.md"), "Set the option `file_chunks` to 4M."),
     r"docs/files.md:\d+: names option `file_chunks`, which does not exist"),
    ("an environment variable that does not exist",
     # (spelled in two pieces: check_docs takes a name any source file holds for a real one)
     lambda r: append(os.path.join(r, "docs/cli.md"), "Or set `PINMEM_FILE_" + "CHUNKS=4M`."),
     r"docs/cli.md:\d+: names PINMEM_FILE_" + "CHUNKS, which is neither"),
    ("install.md without a package tools/deps.sh installs",
     lambda r: edit(os.path.join(r, "docs/install.md"), " `libnuma-dev` |", " |"),
     r"docs/install.md:\d+: group `c` lacks libnuma-dev, which tools/deps.sh installs"),
    ("install.md with a package tools/deps.sh does not install",
     lambda r: edit(os.path.join(r, "docs/install.md"), " `safetensors` ", " `safetensors` `torch` "),
     r"docs/install.md:\d+: group `python` lists torch, which tools/deps.sh does not"),
    ("a long line of prose",
     lambda r: append(os.path.join(r, "docs/python.md"), "word " * 30),
     r"docs/python.md:\d+: a line of 150 characters"),
    ("a wide README table row",
     lambda r: append(os.path.join(r, "README.md"), "| a | " + "b " * 90 + "|"),
     r"README.md:\d+: a table row of \d+ characters \(at most 160"),
]


def main():
    failures = 0
    with tempfile.TemporaryDirectory(prefix="pinmem-check-docs.") as tmp:
        base = os.path.join(tmp, "base")
        os.makedirs(base)
        copy_tree(base)
        before = problems(base)
        if before != problems(ROOT):
            print("test_check_docs: FAIL: the untouched copy reads differently from the tree")
            failures += 1
        # A correct default in prose and the table as they are: nothing new.
        append(os.path.join(base, "docs/loader.md"),
               "Slots go in parts (option `loader_piece`, default 4 MiB); `copy_chunk` (default\n"
               "4M); the default `copy_bounce=auto`.")
        if problems(base) != before:
            print(f"test_check_docs: FAIL: correct defaults reported: {problems(base) - before}")
            failures += 1
        for n, (what, change, want) in enumerate(CASES):
            root = os.path.join(tmp, f"case{n}")
            os.makedirs(root)
            copy_tree(root)
            change(root)
            new = problems(root) - before
            if not any(re.search(want, line) for line in new):
                print(f"test_check_docs: FAIL: {what}: not reported (want /{want}/; new: {sorted(new)})")
                failures += 1
    print(f"test_check_docs: {len(CASES) + 2 - failures} of {len(CASES) + 2} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
