#!/usr/bin/env python3
"""Write the sample outputs in README.md and docs/generate.md from a real run of the quick start's
generate command (stories260K and its shipped drafter, `--compare`), so what the docs show is what the
command prints. The blocks between ``<!-- QUICKSTART-OUTPUT -->`` and ``<!-- /QUICKSTART-OUTPUT -->`` are
replaced; the text is cut after its first sentence or so, with the token count. The MLX compile cache and
the prompt cache are a fresh folder (a first run), and the lines before each block name the machine as ``--machine`` gives it.

    python scripts/docs_outputs.py --machine "a 2-core x86-64 Linux VM, MLX's CPU backend, the other core busy"

Needs models/stories260K (the quick start converts it).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["generate", "--model", "models/stories260K", "--draft-model", "examples/stories260K/drafter",
           "-p", "Once upon a time", "--compare"]
BLOCK = re.compile(r"(<!-- QUICKSTART-OUTPUT -->\n).*?(<!-- /QUICKSTART-OUTPUT -->)", re.S)
MACHINE = re.compile(r"(<!-- QUICKSTART-MACHINE -->).*?(<!-- /QUICKSTART-MACHINE -->)", re.S)


def run() -> str:
    """The command's output as a terminal shows it: the text (cut), then its statistics."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TMPDIR": tmp, "DFLASH_CACHE_DIR": tmp, "COLUMNS": "200"}  # a first run: no caches
        r = subprocess.run([sys.executable, "-m", "dflash_mlx.cli.main", *COMMAND], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    if r.returncode:
        sys.exit(f"the quick start's command failed: {r.stderr.strip()[-500:]}")
    text = " ".join(r.stdout.split())
    cut = text[: text.find(".", 100) + 1] if "." in text[100:] else text[:100]
    tokens = re.search(r"Generation: (\d+) tokens", r.stderr).group(1)
    return f"{cut} [... {tokens} tokens]\n" + r.stderr.rstrip("\n") + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machine", required=True, help="the machine and its state, as the docs should say it")
    args = ap.parse_args()
    output = run()
    for name in ("README.md", "docs/generate.md"):
        path = ROOT / name
        doc = path.read_text()
        if not BLOCK.search(doc):
            sys.exit(f"{name}: no <!-- QUICKSTART-OUTPUT --> block")
        doc = BLOCK.sub(lambda m: m.group(1) + "```\n" + output + "```\n" + m.group(2), doc)
        doc = MACHINE.sub(lambda m: m.group(1) + args.machine + m.group(2), doc)
        path.write_text(doc)
        print(f"wrote {name}")
    print(output)


if __name__ == "__main__":
    main()
