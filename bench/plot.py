#!/usr/bin/env python3
"""Plot GB/s against copy size from `pinmem bench copy --json` output.

usage: bench/plot.py RESULTS.jsonl OUT.png

One panel per direction (H2D, D2H, both at once), one line per case (pinmem's cases solid,
the plain backend copies dashed; log scales). Points whose bytes failed verification are drawn as red
crosses and never joined to a line. The batched rows (4096 x 64 KiB) are listed under the
plot. Lines that are not JSON objects of "bench": "copy" are skipped, so a whole log may be
passed in.
"""
import json
import sys
from collections import defaultdict

DIRS = [("h2d", "host to device"), ("d2h", "device to host"), ("bidir", "both at once")]
CASES = ["pinmem_pageable", "pinmem_pinned", "plain_pageable", "plain_pinned", "plain_wc_pinned",
         "zerocopy_mapped", "managed_prefetch", "pinmem_pageable_ring", "pinmem_pageable_units",
         "dma_under_h2h", "dma_under_read"]


def load(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            # Rows with "applicable": false measure a GPU feature the host backend only
            # imitates: their GB/s mean nothing, so they are not plotted.
            if (r.get("bench") == "copy" and isinstance(r.get("gbps"), (int, float))
                    and r.get("applicable", True) is not False):
                rows.append(r)
    return rows


def verified(r):
    """True when the row's bytes were checked and matched. `verified` is a boolean (the check
    that ran is in `verify_method`); older files held the check's name there instead."""
    v = r.get("verified")
    if isinstance(v, bool):
        return v
    return isinstance(v, str) and v not in ("", "false")


def size_label(n):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def main(argv):
    if len(argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    rows = load(argv[1])
    if not rows:
        sys.stderr.write(f"plot.py: no 'bench copy' JSON lines with gbps in {argv[1]}\n")
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dirs = [d for d in DIRS if any(r.get("dir") == d[0] and "items" not in r for r in rows)]
    fig, axes = plt.subplots(1, len(dirs), figsize=(6.5 * len(dirs), 5.2), squeeze=False)
    backend = rows[0].get("backend", "?")
    names = CASES + sorted({r["case"] for r in rows} - set(CASES))
    # A fixed colour per case (the known ones first), the same in every panel and every plot;
    # tab20 so the dozen cases of one run never share a colour.
    palette = [plt.get_cmap("tab20")(i) for i in range(20)]
    palette = palette[0::2] + palette[1::2]  # the strong shades first, then the light ones
    color = {c: palette[i % len(palette)] for i, c in enumerate(names)}
    sizes_seen = set()
    for ax, (d, title) in zip(axes[0], dirs):
        series = defaultdict(list)
        for r in rows:
            if r.get("dir") != d or "items" in r:
                continue
            size = r["bytes"] // 2 if d == "bidir" else r["bytes"]  # bidir moves size each way
            series[r["case"]].append((size, r["gbps"], verified(r)))
        for case in sorted(series, key=lambda c: (not c.startswith("pinmem"), c)):
            pts = sorted(series[case])
            good = [(x, y) for x, y, ok in pts if ok]
            bad = [(x, y) for x, y, ok in pts if not ok]
            style = "-" if case.startswith("pinmem") else "--"
            if good:
                ax.plot([p[0] for p in good], [p[1] for p in good], style, marker="o",
                        markersize=4, label=case, color=color[case])
            if bad:
                ax.plot([p[0] for p in bad], [p[1] for p in bad], "x", color="red",
                        markersize=9, label=f"{case} (NOT verified)")
            sizes_seen.update(p[0] for p in pts)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted(sizes_seen)
        ax.set_xticks(ticks)
        ax.set_xticklabels([size_label(t) for t in ticks])
        ax.set_title(f"{title} ({backend})")
        ax.set_xlabel("bytes per copy" + (" (each way)" if d == "bidir" else ""))
        ax.set_ylabel("GB/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)

    batch = [r for r in rows if "items" in r]
    if batch:
        lines = []
        for r in batch:
            mark = "" if verified(r) else "  (NOT verified)"
            lines.append(f"{r['dir']} {r['items']} x {size_label(r['item_bytes'])} "
                         f"{r['case']}: {r['gbps']:.1f} GB/s{mark}")
        fig.text(0.01, -0.02, "batched: " + ";  ".join(lines), fontsize=8, va="top", wrap=True)
    fig.suptitle("pinmem bench copy: GB/s against size (median of repeated runs)")
    fig.tight_layout()
    fig.savefig(argv[2], dpi=120, bbox_inches="tight")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
