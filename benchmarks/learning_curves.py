#!/usr/bin/env python3
"""Held-out tau against training steps, one line per run, from the logs `dflash train` writes (its
``step N: held-out tau T at B=16 (...)`` lines), into one PNG and a JSON of the points:

    python benchmarks/learning_curves.py --run "lr 6e-4, 64 blocks=OUT/train-r2.log" \\
        --point "lr 2e-3, 32 blocks (shipped)=500:1.22,1000:1.34" --block-size 16 --out docs/bench/smollm2-curves

``--point`` adds a run known only by its figures (``step:tau,...``), e.g. one whose log is gone.
"""

import argparse
import json
import re
from pathlib import Path


def curve(log: Path, block_size: int):
    """``[(step, tau)]`` of a training log at ``block_size``."""
    points = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"step (\d+): held-out tau (.*)", line)
        if m:
            at = re.search(rf"([\d.]+) at B={block_size}\b", m.group(2))
            if at:
                points.append((int(m.group(1)), float(at.group(1))))
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", default=[], help="LABEL=LOG")
    ap.add_argument("--point", action="append", default=[], help="LABEL=STEP:TAU,STEP:TAU")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True, help="folder for curves.png and curves.json")
    args = ap.parse_args()
    runs = {}
    for item in args.run:
        label, log = item.split("=", 1)
        runs[label] = curve(Path(log), args.block_size)
    for item in args.point:
        label, pts = item.split("=", 1)
        runs[label] = [(int(s), float(t)) for s, t in (p.split(":") for p in pts.split(","))]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curves.json").write_text(json.dumps({"block_size": args.block_size, "runs": runs}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, pts in runs.items():
        ax.plot([s for s, _ in pts], [t for _, t in pts], marker="o", label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"held-out tau at B={args.block_size} (teacher forced)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "curves.png", dpi=120)
    for label, pts in runs.items():
        print(label, pts)


if __name__ == "__main__":
    main()
