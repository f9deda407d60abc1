"""A tiny pair that speaks a tool-call and thinking format, for the server's tool tests.

- :func:`write_tool_tokenizer`: a byte-level BPE tokenizer (ids 0..255 are the
  bytes) with chat, thinking and tool-call special tokens and a chat template that
  renders ``tools``, assistant ``tool_calls`` and ``tool`` results. mlx-lm's own
  loader infers its formats from it: ``<think>``/``</think>`` from the vocabulary,
  the ``json_tools`` parser (``<tool_call>{json}</tool_call>``) from the template.
- :class:`ScriptedTarget`: a tiny random llama whose logits are replaced by a script:
  the next token is a function of the tokens before it, so a random model "calls a
  tool" deterministically. It still runs as a real target (caches, rollback, a
  drafter verified against it), so the server's decoding path is the real one.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Callable, List, Sequence

import mlx.core as mx

from conftest import tiny_drafter, tiny_target
from dflash_mlx.targets.llama import LlamaAdapter

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
            "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB = 272  # 256 bytes + the specials above, rounded up

# Written for these tests: ChatML turns, tools listed as JSON in the system turn, a
# call as <tool_call>{"name": ..., "arguments": ...}</tool_call>, results wrapped in
# <tool_response>, and an open <think> when enable_thinking is set.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools you may call:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for tool_call in m.tool_calls or [] %}{% set tool_call = tool_call.function %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
# The same with calls written as XML-like parameters (mlx-lm infers its qwen3_coder
# parser from the "<tool_call>\n<function=" in it).
CODER_TEMPLATE = TEMPLATE.replace(
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}</tool_call>",
    "<tool_call>\n<function={{ tool_call.name }}>\n{% for k, v in tool_call.arguments.items() %}"
    "<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>")
assert CODER_TEMPLATE != TEMPLATE


def write_tool_tokenizer(out: Path, template: str = TEMPLATE) -> Path:
    """Save the tokenizer described above (with ``template``) in ``out``; returns ``out``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = template
    hf.save_pretrained(out)
    return out


def load_tool_tokenizer(folder: Path):
    """mlx-lm's ``TokenizerWrapper`` over the tokenizer in ``folder`` (its loader
    infers the tool parser and the thinking tokens)."""
    from mlx_lm.tokenizer_utils import load

    return load(Path(folder))


Script = Callable[[List[int]], int]


class ScriptedTarget(LlamaAdapter):
    """A llama adapter whose head answers ``script(tokens so far)`` at every position.

    The tokens each position has seen are tracked from the cache's offset, so
    rollbacks, reused caches and prefill chunks all see the right history.

    Args:
        model: the tiny llama (its layers still run; only the logits are scripted).
        script: ``script(history) -> next token id``.
    """

    def __init__(self, model, script: Script):
        super().__init__(model)
        self.script, self.seen = script, []

    def __call__(self, inputs, cache, capture=None, tree=None):
        start = cache[0].offset
        out = super().__call__(inputs, cache, capture, tree)
        self.seen = self.seen[:start] + [int(t) for t in inputs[0].tolist()]
        return out

    def plain_head(self, h: mx.array) -> mx.array:
        """The model's own head (the drafter's)."""
        return super().lm_head(h)

    def lm_head(self, h: mx.array) -> mx.array:
        """[1, H] or [1, L, H] -> logits of the same rank: 30 on the scripted token of
        each of the last forward's final positions, 0 elsewhere (``h`` is not read)."""
        n = 1 if h.ndim == 2 else h.shape[1]  # the last n positions of the last forward
        ends = range(len(self.seen) - n + 1, len(self.seen) + 1)
        ids = mx.array([self.script(self.seen[:e]) for e in ends], dtype=mx.int32)
        logits = 30.0 * (mx.arange(self.vocab_size)[None] == ids[:, None]).astype(mx.float32)
        return logits if h.ndim == 2 else logits[None]


def reply_script(tokenizer, replies: Callable[[List[int]], str]) -> Script:
    """A script that answers each assistant turn with ``replies(prompt ids)`` (text
    with special tokens spelled out), then ``<|im_end|>``; before the turn, anything."""
    head = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def script(history: List[int]) -> int:
        at = _last_index(history, head)
        if at < 0:
            return 0
        start = at + len(head)
        planned = tokenizer.encode(replies(history[:start]), add_special_tokens=False) + [end]
        done = len(history) - start
        return planned[done] if done < len(planned) else end

    return script


def _last_index(seq: Sequence[int], sub: Sequence[int]) -> int:
    for i in range(len(seq) - len(sub), -1, -1):
        if list(seq[i:i + len(sub)]) == list(sub):
            return i
    return -1


def scripted_pair(folder: Path, replies: Callable[[List[int]], str], context: int = 2048):
    """A pair (as ``dflash serve`` takes it) of a scripted target, a random drafter
    and the tool tokenizer saved in ``folder``."""
    tokenizer = load_tool_tokenizer(folder)
    model, _ = tiny_target("llama", vocab=VOCAB)
    model.args.max_position_embeddings = context
    target = ScriptedTarget(model, reply_script(tokenizer, replies))
    drafter = tiny_drafter(target)
    drafter.bind(target.embed, target.plain_head)
    return SimpleNamespace(model=model, target=target, tokenizer=tokenizer, drafter=drafter,
                           draft_path="tiny-drafter")
