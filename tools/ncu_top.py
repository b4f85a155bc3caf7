"""Summarize Nsight Compute's source page (``ncu -i REP --page source --csv --print-source sass``): the SASS lines
with the most warp-stall samples, the samples summed by opcode, and by stall reason where the CSV has a column
per reason.

    python3 tools/ncu_top.py SRC.csv [--top N]
"""

import argparse
import collections
import csv
import re


def num(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, ln in enumerate(lines) if "Source" in ln and "," in ln), None)
    if start is None:
        print("no header with a Source column; first lines:")
        print("\n".join(lines[:10]))
        return
    rows = list(csv.reader(lines[start:]))
    head, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    print(f"{len(body)} SASS lines; columns: {head}")
    src = head.index("Source")
    samp = next((i for i, h in enumerate(head) if "Sampling" in h and "All" in h), None)
    if samp is None:
        samp = next((i for i, h in enumerate(head) if "Sampling" in h), None)
    if samp is None:
        print("no sampling column")
        return
    nis = next((i for i, h in enumerate(head) if "Sampling" in h and "Not" in h), None)
    total = sum(num(r[samp]) for r in body) or 1.0
    print(f"samples: {total:.0f} ({head[samp]})")
    by_op = collections.Counter()
    for r in body:
        m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z0-9_]+)", r[src])
        by_op[m.group(2) if m else "?"] += num(r[samp])
    print("by opcode:", ", ".join(f"{op} {v / total:.1%}" for op, v in by_op.most_common(20)))
    reasons = [i for i, h in enumerate(head) if h.lower().startswith("stall") or "stall_" in h.lower()]
    if reasons:
        tot = {head[i]: sum(num(r[i]) for r in body) for i in reasons}
        s = sum(tot.values()) or 1.0
        print("by reason:", ", ".join(f"{k} {v / s:.1%}" for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:14]))
    step = max(1, len(body) // 32)
    print(f"by region ({step} lines each; where in the kernel the samples fall):")
    print("  " + " ".join(f"{sum(num(r[samp]) for r in body[j:j + step]) / total:.0%}"
                          for j in range(0, len(body), step)))
    order = sorted(range(len(body)), key=lambda i: -num(body[i][samp]))
    print(f"top {args.top} lines (index, samples %, not-issued %, source):")
    for i in order[: args.top]:
        r = body[i]
        extra = f" {num(r[nis]) / total:5.1%}" if nis is not None else ""
        print(f"  {i:5d} {num(r[samp]) / total:5.1%}{extra}  {r[src][:110]}")


if __name__ == "__main__":
    main()
