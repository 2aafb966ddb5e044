#!/usr/bin/env python3
"""Which source files of src/ call each other in a loop?

Reads the object files' symbol tables (nm): file A depends on file B when A uses a symbol that B
defines. Prints every cycle (a strongly connected component of more than one file) with the
symbols behind each edge, and exits 1 if there is one. Arguments: object files or folders of
them (the CTest passes $<TARGET_OBJECTS:pinmem_objects>, so it runs in every build folder,
with or without the cuda backend).
"""
import collections
import os
import subprocess
import sys


def objects(args):
    for a in args:
        if os.path.isdir(a):
            for root, _, files in os.walk(a):
                for f in sorted(files):
                    if f.endswith(".o"):
                        yield os.path.join(root, f)
        elif a.endswith(".o"):
            yield a


def source_name(path):
    name = os.path.basename(path)
    return name[:-2] if name.endswith(".o") else name


def main(argv):
    objs = list(objects(argv[1:]))
    if not objs:
        print("check_layers: no object files given", file=sys.stderr)
        return 2
    defs, uses = {}, collections.defaultdict(set)
    for o in objs:
        name = source_name(o)
        out = subprocess.run(["nm", o], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            p = line.split()
            if len(p) == 3 and p[1] in "TDBRVWGS":
                defs[p[2]] = name
            elif len(p) == 2 and p[0] == "U":
                uses[name].add(p[1])
    g = collections.defaultdict(lambda: collections.defaultdict(set))
    for a, syms in uses.items():
        for s in syms:
            b = defs.get(s)
            if b and b != a:
                g[a][b].add(s)
    # strongly connected components (Tarjan)
    idx, low, st, on, comps, n = {}, {}, [], set(), [], [0]

    def sc(v):
        idx[v] = low[v] = n[0]
        n[0] += 1
        st.append(v)
        on.add(v)
        for w in g[v]:
            if w not in idx:
                sc(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], idx[w])
        if low[v] == idx[v]:
            comp = []
            while True:
                w = st.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(set(g) | set(defs.values())):
        if v not in idx:
            sc(v)
    for c in comps:
        print("cycle:", " ".join(c))
        for a in c:
            for b in sorted(x for x in g[a] if x in c):
                print("    %s -> %s: %s" % (a, b, " ".join(sorted(g[a][b]))))
    if not comps:
        print("check_layers: %d object files, no cycles" % len(objs))
    return 1 if comps else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
