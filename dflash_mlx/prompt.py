"""Prompt token ids from chat messages: the tokenizer's chat template, or plain text."""

from typing import Callable, Dict, List, Optional, Sequence

Messages = Sequence[Dict[str, str]]


def encode_messages(tokenizer, messages: Messages, template: Optional[dict] = None, use_template: bool = True,
                    plain: Callable[[Messages], str] = lambda ms: "\n".join(m["content"] for m in ms)) -> List[int]:
    """Token ids for ``messages`` followed by the assistant's turn.

    With a chat template (and ``use_template``), the rendered text is encoded without adding special tokens, as
    ``mlx_lm.generate`` does; ``template`` holds extra ``apply_chat_template`` keyword arguments (e.g.
    ``enable_thinking``). Otherwise ``plain(messages)`` (default: their contents joined by newlines) is encoded with the
    tokenizer's special tokens (BOS).
    """
    if use_template and tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                             **(template or {}))
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(plain(messages), add_special_tokens=True))


def plain_text(messages: Messages) -> str:
    """A conversation for a model without a chat template: a reply continues its user
    turn directly; every other turn starts on a new line."""
    out = ""
    for m in messages:
        out += m["content"] if m["role"] == "assistant" or not out else "\n" + m["content"]
    return out


def context_length(model) -> Optional[int]:
    """The context in tokens (``args.max_position_embeddings``) of a model or target adapter, or None."""
    return getattr(getattr(model, "args", None), "max_position_embeddings", None) or None
