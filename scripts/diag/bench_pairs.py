"""Each ft bench log's (decode, verify) pairs and their ratios; then, per tree (the log name's ab-<tree>-r<i>), the
medians over all its pairs and the trees' relative differences. Usage: python3 bench_pairs.py LOG [LOG ...]."""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict


def pairs_of(path: str) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in open(path) if line.startswith('{"setting"')]
    decode = [r["step_ms_median"] for r in rows if r["step"] == "decode"]
    verify = [r["step_ms_median"] for r in rows if r["step"] == "verify"]
    return list(zip(decode, verify))


def main(paths: list[str]) -> None:
    by_tree: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for path in paths:
        tree = re.search(r"ab-([^/]+?)-r\d+\.log$", path)
        pairs = pairs_of(path)
        by_tree[tree.group(1) if tree else path] += pairs
        for d, v in pairs:
            print(f"{path}: decode {d:.3f} ms  verify {v:.3f} ms  ratio {v / d:.3f}")
    medians = {}
    for tree, pairs in by_tree.items():
        if not pairs:
            print(f"{tree}: no pairs")
            continue
        d, v = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        medians[tree] = (d, v)
        print(f"{tree}: {len(pairs)} pairs, median decode {d:.3f} ms, verify {v:.3f} ms, "
              f"median ratio {statistics.median(p[1] / p[0] for p in pairs):.3f}")
    if {"base", "this"} <= medians.keys():
        (d0, v0), (d1, v1) = medians["base"], medians["this"]
        print(f"this vs base: decode {100 * (d1 / d0 - 1):+.2f}%, verify {100 * (v1 / v0 - 1):+.2f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
