"""The story openings the batch benchmarks send to stories260K (a module of its own, free of
dflash_mlx imports, so a benchmark run from an older checkout can import it)."""

PROMPTS = ["Once upon a time", "One day, a little boy", "The cat sat on", "Lily and Ben went to",
           "Tom had a big red", "The sun was hot and", "Sara found a shiny", "A little dog named"]
