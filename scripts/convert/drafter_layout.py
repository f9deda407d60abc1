#!/usr/bin/env python3
r"""Convert a drafter in the older layout to the released layout (DFLASH_SPEC.md section 2).

The older layout keeps ``block_size``, ``target_layer_ids`` and ``mask_token_id``
at the top level of ``config.json`` and has no ``dflash_config``. The released
layout keeps ``block_size`` at the top level and moves the other two into
``dflash_config``; ``dflash convert`` and the authors' loader read that.

This script rewrites ``config.json`` only: every other key is kept, and the weight
files are copied byte for byte. The result is loaded with ``load_drafter`` (strict:
every weight must match the config) before it is moved into place. A config
without ``target_layer_ids`` gets the evenly spread ids older code assumed (from
``num_target_layers``), printed so you can check them; ``--target-layer-ids``
overrides. Nothing is written on error or Ctrl-C.

Example:
    python scripts/convert/drafter_layout.py old-drafter/ drafter/
    dflash convert --model Qwen/Qwen3-8B --draft-model drafter/ --out qwen3-8b-dflash
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import List, Optional

from dflash_mlx.drafter.checkpoint import load_drafter, read_config
from dflash_mlx.pair.convert import check_out, staging
from dflash_mlx.drafter.config import DRAFTER_ARCHITECTURE, default_target_layer_ids
from dflash_mlx.errors import ConfigError, DFlashError

MOVED = ("target_layer_ids", "mask_token_id")


def released_config(config: dict, source: str = "config.json",
                    target_layer_ids: Optional[List[int]] = None,
                    mask_token_id: Optional[int] = None) -> dict:
    """The released-layout config for an older-layout one.

    Args:
        config: the older ``config.json``.
        source: its path, for error messages.
        target_layer_ids, mask_token_id: values to use instead of the config's.

    Returns:
        A new dict: ``dflash_config`` holds ``target_layer_ids`` and
        ``mask_token_id``; they leave the top level; other keys are kept.

    Raises:
        ConfigError: already released layout, or a value that cannot be found.
    """
    if "dflash_config" in config:
        raise ConfigError(f"{source}: already in the released layout (has 'dflash_config')")
    new = {k: v for k, v in config.items() if k not in MOVED}
    ids = target_layer_ids if target_layer_ids is not None else config.get("target_layer_ids")
    if ids is None:
        n_target, n_layers = config.get("num_target_layers"), config.get("num_hidden_layers")
        if n_target is None or n_layers is None:
            raise ConfigError(f"{source}: no 'target_layer_ids' and no 'num_target_layers' to derive them; "
                              "pass --target-layer-ids")
        ids = default_target_layer_ids(int(n_target), int(n_layers))
        print(f"target_layer_ids not in {source}: using the evenly spread {ids} "
              f"({n_target} target layers); pass --target-layer-ids if they differ", file=sys.stderr)
    mask = mask_token_id if mask_token_id is not None else config.get("mask_token_id")
    if mask is None:
        raise ConfigError(f"{source}: missing key 'mask_token_id'; pass --mask-token-id")
    new["dflash_config"] = {"target_layer_ids": [int(i) for i in ids], "mask_token_id": int(mask)}
    new.setdefault("architectures", [DRAFTER_ARCHITECTURE])
    return new


def convert_layout(src: Path, out: Path, force: bool = False,
                   target_layer_ids: Optional[List[int]] = None,
                   mask_token_id: Optional[int] = None) -> Path:
    """Write ``out`` (released layout) from ``src`` (older layout); see the module docstring.

    Raises:
        DFlashError: a bad config, unreadable weights, or ``out`` exists without ``force``.
    """
    src, out = Path(src), Path(out)
    check_out(out, force, flag="OUT")
    config = released_config(read_config(src / "config.json"), str(src / "config.json"),
                             target_layer_ids, mask_token_id)
    with staging(out, force, flag="OUT") as tmp:
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name != "config.json":
                shutil.copy(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        load_drafter(str(tmp))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="drafter folder in the older layout")
    parser.add_argument("out", type=Path, help="output folder (released layout)")
    parser.add_argument("--target-layer-ids", help="comma-separated ids, e.g. 1,9,17,25,33")
    parser.add_argument("--mask-token-id", type=int)
    parser.add_argument("--force", action="store_true", help="replace an existing output folder")
    args = parser.parse_args(argv)
    ids = [int(i) for i in args.target_layer_ids.split(",")] if args.target_layer_ids else None
    try:
        out = convert_layout(args.src, args.out, args.force, ids, args.mask_token_id)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"error: interrupted; nothing was written to {args.out}", file=sys.stderr)
        return 130
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
