#!/usr/bin/env python3
"""Check the user docs (README.md, docs/*.md, bench/README.md), so that they cannot go stale
unseen:

- every relative link points to a file that exists (and, for a #fragment into a Markdown file,
  to one of its headings), and every results file a doc names exists in bench/results/;
- every option default a doc quotes equals the option table in force (src/core/config.c, and
  `pinmem --json info --options` too when --pinmem BIN is given): the rows of an option table
  (| `name` | `PINMEM_NAME` | `default` |), and prose such as "option `file_chunk`, default
  2 MiB", "`loader_piece` (default 4 MiB)", "the default `copy_bounce=auto`" or "`numa_threads=1`
  (the default)"; sizes compare by value (2M = 2 MiB = 2097152);
- every option a doc names exists: `PINMEM_NAME` (an option's variable, or one the sources
  read), "option `name`" and "options `a`, `b`";
- docs/install.md's table of dependency groups lists the packages of `tools/deps.sh --list`;
- lines of prose (outside code blocks and tables) stay under 120 characters, and the README's
  table rows at most 160.

With --unused, also list the files of bench/results/ that no doc names (candidates for
removal). Exit status 1 on any problem.

    python3 tests/check_docs.py [--unused] [--pinmem BIN] [ROOT]
"""
import glob
import json
import os
import re
import subprocess
import sys

PROSE_MAX = 120  # a prose line must be shorter
README_ROW_MAX = 160

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RESULT = re.compile(r"[\w.-]+-\d{4}-\d{2}-\d{2}[a-z]?-[\w.-]+\.(?:jsonl|txt|png)")


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    out = set()
    in_code = False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


# ---- the option table ----------------------------------------------------------------------

ROW = re.compile(r'\[PM__OPT_\w+\]\s*=\s*\{\s*"([a-z0-9_]+)",\s*"(PINMEM_[A-Z0-9_]+)",\s*"([^"]*)"')


def option_table(root, pinmem=None):
    """{name: (env, default)} from src/core/config.c; with a pinmem binary, its own table too,
    and any difference between the two is a problem (returned as the second value)."""
    text = open(os.path.join(root, "src", "core", "config.c"), encoding="utf-8").read()
    table = {m[0]: (m[1], m[2]) for m in ROW.findall(text)}
    problems = []
    if pinmem:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PINMEM_")}
        env["PINMEM_BACKEND"] = "host"
        out = subprocess.run([pinmem, "--json", "info", "--options"], env=env, check=True,
                             capture_output=True, text=True).stdout
        live = {}
        for line in out.splitlines():
            o = json.loads(line)
            if o.get("info") == "option":
                live[o["name"]] = (o["env"], o["default"])
        if live != table:
            problems.append(f"{pinmem} info --options and src/core/config.c differ: "
                            f"{sorted(set(live.items()) ^ set(table.items()))}")
    if not table:
        problems.append("src/core/config.c: no option rows found")
    return table, problems


def env_names_read(root):
    """The PINMEM_ variables the sources, tests and build read (not options, but real)."""
    names = set()
    for pattern in ("src/**/*.[ch]", "tools/*.[ch]", "python/**/*.[ch]", "python/**/*.py",
                    "tests/**/*.[ch]", "tests/**/*.py", "tests/*.sh", "bench/*.sh", "bench/*.py",
                    "CMakeLists.txt", "**/CMakeLists.txt", "Makefile", "pyproject.toml",
                    "cmake/*"):
        for f in glob.glob(os.path.join(root, pattern), recursive=True):
            try:
                names.update(re.findall(r"PINMEM_[A-Z0-9_]+", open(f, encoding="utf-8").read()))
            except (UnicodeDecodeError, IsADirectoryError):
                pass
    return names


SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b|bytes?)?$")


def norm(value):
    """A default as a comparable value: sizes in bytes, else the lower-case text."""
    v = value.strip().strip("`").strip().lower()
    v = re.sub(r"\s*(?:s|seconds?)$", "", v) if re.match(r"^\d", v) else v
    m = SIZE.match(v)
    if m:
        n = float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " ")
        return str(int(n)) if n == int(n) else str(n)
    return v


VALUE = r"`?(\d[\d.]*(?:\s?(?:[KMGT]i?B|[KMGT]|bytes?|s)\b)?|`[^`]+`)`?"
# Prose forms that quote an option's default; NAME is an option or its PINMEM_ variable.
CLAIMS = [
    # `name` (default 4 MiB) / option `name`, default 2 MiB / `name` defaults to 4 / `name`, by default 4
    re.compile(r"`(?P<name>[A-Za-z0-9_]+)`,?\s*\(?(?:by\s+)?default(?:s to|:)?\s+(?:is\s+)?" + VALUE),
    # the default `name=value` / default is `name=value`
    re.compile(r"default(?: is)?,?\s+`(?P<name>[a-z0-9_]+)=(?P<v>[^`]+)`"),
    # `name=value` (the default / , the default / is the default
    re.compile(r"`(?P<name>[a-z0-9_]+)=(?P<v>[^`]+)`\s*(?:\(|,|is)\s*(?:the|its)\s+default\b"),
    # so `file_chunk` is 2 MiB (a size or a number stated as the option's value)
    re.compile(r"`(?P<name>[a-z0-9_]+)` is (?P<v>\d+(?:\.\d+)?\s?(?:[KMGT]i?B|[KMGT])?)(?!\w)"),
]
TABLE_ROW = re.compile(r"^\|\s*`([a-z0-9_]+)`\s*\|\s*`(PINMEM_[A-Z0-9_]+)`\s*\|\s*`([^`]*)`\s*\|")
NAMED = re.compile(r"\boptions?\s+((?:`[a-z0-9_]+`(?:=\S*)?(?:,\s*|\s+and\s+|\s+or\s+)?)+)")


def prose_paragraphs(text):
    """(first line number, paragraph text) for the prose and table rows outside code blocks."""
    out, cur, start, in_code = [], [], 0, False
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            in_code = not in_code
            line = ""
        if in_code or not line.strip() or line.startswith("|"):
            if cur:
                out.append((start, " ".join(cur)))
                cur = []
            if not in_code and line.startswith("|"):
                out.append((n, line))
            continue
        if not cur:
            start = n
        cur.append(line.strip())
    if cur:
        out.append((start, " ".join(cur)))
    return out


def check_options(rel, text, table, env_read, bad):
    by_env = {env: name for name, (env, _) in table.items()}
    for n, para in prose_paragraphs(text):
        m = TABLE_ROW.match(para)
        if m:
            name, env, default = m.groups()
            if name not in table:
                bad.append(f"{rel}:{n}: the table lists option `{name}`, which does not exist")
            elif table[name] != (env, default):
                bad.append(f"{rel}:{n}: option `{name}` reads `{env}` `{default}`; the option "
                           f"table has `{table[name][0]}` `{table[name][1]}`")
            continue
        for rx in CLAIMS:
            for m in rx.finditer(para):
                name = m.group("name")
                name = by_env.get(name, name)
                if name not in table:
                    continue  # a function's argument, a CLI flag: not an option
                value = m.group("v") if "v" in rx.groupindex else m.group(2)
                if norm(value) != norm(table[name][1]):
                    bad.append(f"{rel}:{n}: quotes the default of `{name}` as {value.strip('`')}; "
                               f"the option table says {table[name][1]}")
        for env in re.findall(r"PINMEM_[A-Z0-9_]+", para):
            if env not in by_env and env not in env_read:
                bad.append(f"{rel}:{n}: names {env}, which is neither an option's variable nor "
                           "read anywhere")
        for m in NAMED.finditer(para):
            for name in re.findall(r"`([a-z0-9_]+)", m.group(1)):
                if name not in table:
                    bad.append(f"{rel}:{n}: names option `{name}`, which does not exist")


INSTALL_ROW = re.compile(r"^\|\s*`(c|test|python|wheel)`\s*\|[^|]*\|(.*)\|\s*$")


def check_install(root, bad):
    """docs/install.md's dependency table against tools/deps.sh's lists, group by group."""
    doc = os.path.join(root, "docs", "install.md")
    deps = os.path.join(root, "tools", "deps.sh")
    if not (os.path.exists(doc) and os.path.exists(deps)):
        return
    listed = {}
    for n, line in enumerate(open(doc, encoding="utf-8"), 1):
        m = INSTALL_ROW.match(line)
        if m:
            listed[m.group(1)] = (n, set(re.findall(r"`([^`]+)`", m.group(2))))
    for group in ("c", "test", "python", "wheel"):
        out = subprocess.run(["bash", deps, "--list", group], capture_output=True, text=True)
        want = set(out.stdout.split())
        if out.returncode or not want:
            bad.append(f"tools/deps.sh --list {group} failed: {out.stderr.strip()}")
            continue
        if group not in listed:
            bad.append(f"docs/install.md: no row for the dependency group `{group}`")
            continue
        n, have = listed[group]
        for name in sorted(want - have):
            bad.append(f"docs/install.md:{n}: group `{group}` lacks {name}, which tools/deps.sh "
                       "installs")
        for name in sorted(have - want):
            bad.append(f"docs/install.md:{n}: group `{group}` lists {name}, which tools/deps.sh "
                       "does not")


def check_lines(rel, text, bad):
    in_code = False
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        if line.startswith("|"):
            if rel == "README.md" and len(line) > README_ROW_MAX:
                bad.append(f"{rel}:{n}: a table row of {len(line)} characters (at most "
                           f"{README_ROW_MAX} in the README)")
        elif len(line) >= PROSE_MAX and " " in line.strip():
            bad.append(f"{rel}:{n}: a line of {len(line)} characters (prose stays under "
                       f"{PROSE_MAX})")


def main(argv):
    unused = "--unused" in argv
    pinmem = None
    args = []
    it = iter(argv)
    for a in it:
        if a == "--pinmem":
            pinmem = next(it, None)
        elif a != "--unused":
            args.append(a)
    root = os.path.abspath(args[0] if args else os.path.join(os.path.dirname(__file__), ".."))
    table, table_problems = option_table(root, pinmem)
    env_read = env_names_read(root)
    docs = [os.path.join(root, "README.md"), os.path.join(root, "bench", "README.md")]
    docs += sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    results = os.path.join(root, "bench", "results")
    bad, named = list(table_problems), set()
    for doc in docs:
        if not os.path.exists(doc):
            continue
        rel = os.path.relpath(doc, root)
        text = open(doc, encoding="utf-8").read()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(full):
                bad.append(f"{rel}: link to {target}: no such file")
            elif frag and full.endswith(".md") and frag not in anchors(full):
                bad.append(f"{rel}: link to {target}: no heading #{frag} there")
        check_options(rel, text, table, env_read, bad)
        check_lines(rel, text, bad)
        for name in RESULT.findall(text):
            named.add(name)
            if not os.path.exists(os.path.join(results, name)):
                bad.append(f"{rel}: names {name}, which is not in bench/results/")
    check_install(root, bad)
    for line in bad:
        print(line)
    if unused:
        for f in sorted(os.listdir(results)) if os.path.isdir(results) else []:
            if f not in named:
                print(f"unused: bench/results/{f}")
    print(f"check_docs: {len(docs)} documents, {len(table)} options, {len(named)} results files "
          f"named, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
