"""The stories260K helpers the benchmarks share: the story openings the batch benchmarks send, and
the conversion of ../shared's llama2c checkpoint (free of dflash_mlx imports, so a benchmark run
from an older checkout can import it)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260K"
PROMPTS = ["Once upon a time", "One day, a little boy", "The cat sat on", "Lily and Ben went to",
           "Tom had a big red", "The sun was hot and", "Sara found a shiny", "A little dog named"]


def convert_stories260k(out: Path) -> Path:
    """../shared's stories260K as an mlx-lm folder at ``out`` (scripts/convert/llama2c.py)."""
    spec = importlib.util.spec_from_file_location("llama2c", ROOT / "scripts" / "convert" / "llama2c.py")
    llama2c = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llama2c)
    return llama2c.convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.model", out)
