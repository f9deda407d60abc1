"""A GGUF file's tokenizer (llama.cpp's ``tokenizer.ggml.*`` metadata) as a Hugging Face fast tokenizer, built with the
``tokenizers`` library: byte-level BPE (``tokenizer.ggml.model`` "gpt2": GPT-2, Llama 3, Qwen2, SmolLM) and
SentencePiece-style BPE with byte fallback ("llama": Llama 2, TinyLlama, Mistral).

Keys read (llama.cpp's ``gguf-py/gguf/constants.py`` names): ``tokenizer.ggml.model``, ``.pre``, ``.tokens``,
``.scores``, ``.token_type``, ``.merges``, ``.bos_token_id``, ``.eos_token_id``, ``.unknown_token_id``,
``.padding_token_id``, ``.add_bos_token``, ``.add_space_prefix`` and ``tokenizer.chat_template``."""

from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..errors import ConfigError

# llama.cpp's token types (llama_token_type): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
CONTROL, USER_DEFINED = 3, 4

# The pre-tokenizer split of each byte-level vocabulary, by ``tokenizer.ggml.pre`` (llama.cpp's
# llama-vocab.cpp regexes). None: GPT-2's own split (ByteLevel's regex). "digits": every digit alone,
# then GPT-2's split (StarCoder's vocabulary, which SmolLM uses).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL_SPLITS = {
    "default": None, "gpt-2": None, "gpt2": None, "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3, "falcon3": _LLAMA3, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits"}
LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "falcon3")  # llama.cpp: merges ignored, BOS added by default


def metadata_value(metadata: dict, key: str, source: Path, default=None, required: bool = False):
    """``metadata[key]``, else ``default``; ConfigError naming the file and the key where ``required`` and absent."""
    value = metadata.get(key, default)
    if required and value is None:
        raise ConfigError(f"{source}: missing GGUF metadata key '{key}'")
    return value


def save_tokenizer(metadata: dict, source: Path, dst: Path) -> None:
    """The vocabulary in ``metadata`` (:func:`~.gguf.read_gguf`'s) as a Hugging Face tokenizer in ``dst``: built with
    ``tokenizers`` (control tokens whole and special, user-defined tokens whole) into ``tokenizer.json``, read back
    once freed by transformers' ``PreTrainedTokenizerFast`` with the special tokens and chat template, which writes its
    files (``tokenizer_config.json``...). Given the object, it copies it: 300 MB for Gemma 3's 262,144 entries.

    Raises:
        ConfigError: a key is missing, or ``tokenizer.ggml.model``/``tokenizer.ggml.pre`` names a tokenizer
            not supported here (names the file, the key and the value).
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    kind = metadata_value(metadata, "tokenizer.ggml.model", source, required=True)
    tokens: List[str] = metadata_value(metadata, "tokenizer.ggml.tokens", source, required=True)
    types = metadata_value(metadata, "tokenizer.ggml.token_type", source) or [1] * len(tokens)
    builders = {"gpt2": _byte_level, "llama": _sentencepiece}  # tokenizer.ggml.model -> its tokenizer
    if kind not in builders:
        raise ConfigError(f"{source}: tokenizer.ggml.model '{kind}' is not supported (only {' and '.join(builders)})")
    tokenizer = builders[kind](metadata, tokens, source)
    _add_bos(tokenizer, metadata, tokens, source)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types) if k == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, k in zip(tokens, types) if k == USER_DEFINED])
    tokenizer.save(str(dst / "tokenizer.json"))
    del tokenizer
    ids = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}  # transformers' name: the GGUF key's
    specials = {f"{name}_token": tokens[i] for name, key in ids.items()
                if 0 <= (i := metadata.get(f"tokenizer.ggml.{key}_token_id", -1)) < len(tokens)}
    PreTrainedTokenizerFast(tokenizer_file=str(dst / "tokenizer.json"), clean_up_tokenization_spaces=False,
                            chat_template=metadata.get("tokenizer.chat_template"), **specials).save_pretrained(str(dst))


def _byte_level(metadata: dict, tokens: List[str], source: Path):
    """GPT-2-style byte-level BPE: the file's tokens are spelled in GPT-2's byte alphabet, merges given."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = metadata_value(metadata, "tokenizer.ggml.merges", source, required=True)
    pre = metadata_value(metadata, "tokenizer.ggml.pre", source, default="default")
    if pre not in BYTE_LEVEL_SPLITS:
        raise ConfigError(f"{source}: tokenizer.ggml.pre '{pre}' is not supported "
                          f"(supported: {', '.join(sorted(BYTE_LEVEL_SPLITS))})")
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], ignore_merges=pre in LLAMA3_PRE))
    split = BYTE_LEVEL_SPLITS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in (None, "digits"))
    if split is None:
        tokenizer.pre_tokenizer = byte_level
    else:  # digits alone, or the vocabulary's regex, before the byte-level step
        first = pre_tokenizers.Digits(individual_digits=True) if split == "digits" else pre_tokenizers.Split(
            Regex(split), behavior="isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([first, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(metadata: dict, tokens: List[str], source: Path):
    """SentencePiece BPE with byte fallback (``<0xNN>`` pieces): merges from the file, or recovered from the
    pieces' scores (a merge ranks as the piece it makes); spaces are ``▁``, with one prepended to the text
    unless ``tokenizer.ggml.add_space_prefix`` is false."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    merges = metadata_value(metadata, "tokenizer.ggml.merges", source)
    if merges is not None:
        merges = [tuple(m.split(" ", 1)) for m in merges]
    elif (scores := metadata_value(metadata, "tokenizer.ggml.scores", source)) is not None:
        merges = merges_from_scores(tokens, scores)
    else:
        raise ConfigError(f"{source}: missing GGUF metadata key 'tokenizer.ggml.scores' (or "
                          "'tokenizer.ggml.merges'), needed to rebuild a SentencePiece vocabulary")
    unk = metadata_value(metadata, "tokenizer.ggml.unknown_token_id", source, default=0)
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
    prefix = metadata_value(metadata, "tokenizer.ggml.add_space_prefix", source, default=True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                          + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


def _add_bos(tokenizer, metadata: dict, tokens: List[str], source: Path) -> None:
    """Prepend BOS to every encoding when ``tokenizer.ggml.add_bos_token`` says so (llama.cpp's default:
    yes for SentencePiece vocabularies and the byte-level ones of :data:`LLAMA3_PRE`, else no)."""
    from tokenizers import processors

    bos = metadata_value(metadata, "tokenizer.ggml.bos_token_id", source)
    default = metadata["tokenizer.ggml.model"] == "llama" or metadata.get("tokenizer.ggml.pre") in LLAMA3_PRE
    if bos is None or not metadata_value(metadata, "tokenizer.ggml.add_bos_token", source, default=default):
        return
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])


def merges_from_scores(tokens: List[str], scores: List[float]) -> List[Tuple[str, str]]:
    """SentencePiece BPE's merges, recovered from its pieces: each way to cut a piece into two pieces of the
    vocabulary is a merge, ranked by the made piece's score (highest first), ties by the pieces' ids."""
    ids: Dict[str, int] = {t: i for i, t in enumerate(tokens)}
    ranked = []  # (-score, left id, right id): no strings held per merge (515K merges in Gemma 3's vocabulary)
    for piece, index in ids.items():
        for cut in range(1, len(piece)):
            if (left := ids.get(piece[:cut])) is not None and (right := ids.get(piece[cut:])) is not None:
                ranked.append((-scores[index], left, right))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, left, right in ranked]
