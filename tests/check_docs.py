#!/usr/bin/env python3
"""Check the user docs: every relative link in README.md, docs/*.md and bench/README.md points to
a file that exists (and, for a #fragment into a Markdown file, to one of its headings), and every
results file a doc names exists. With --unused, also list the files of bench/results/ that no
doc names (candidates for removal). Exit status 1 on a broken link.

    python3 tests/check_docs.py [--unused] [ROOT]
"""
import glob
import os
import re
import sys

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


def main(argv):
    unused = "--unused" in argv
    args = [a for a in argv if a != "--unused"]
    root = os.path.abspath(args[0] if args else os.path.join(os.path.dirname(__file__), ".."))
    docs = [os.path.join(root, "README.md"), os.path.join(root, "bench", "README.md")]
    docs += sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    results = os.path.join(root, "bench", "results")
    bad, named = [], set()
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
        for name in RESULT.findall(text):
            named.add(name)
            if not os.path.exists(os.path.join(results, name)):
                bad.append(f"{rel}: names {name}, which is not in bench/results/")
    for line in bad:
        print(line)
    if unused:
        for f in sorted(os.listdir(results)) if os.path.isdir(results) else []:
            if f not in named:
                print(f"unused: bench/results/{f}")
    print(f"check_docs: {len(docs)} documents, {len(named)} results files named, "
          f"{len(bad)} broken")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
