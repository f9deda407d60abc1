"""ChatSession: cache reuse across turns is exact, interrupts and /reset leave both
caches consistent, the context limit is enforced, reply pieces are tagged right."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

from dflash_mlx import InputError, generate_step, load
from dflash_mlx.chat.session import ChatSession, ContextFullError, ReplyDecoder, starts_thinking
from dflash_mlx.prompt import plain_text
from dflash_mlx.prompt_cache.pair import common_prefix, trim_cache
from dflash_mlx.targets.hybrid import HybridAdapter
from conftest import needs_shared, tiny_drafter, tiny_target

THINK, UNTHINK = 3, 4
TURNS = ["hello there", "and then?", "more, please"]


class ByteTokenizer:
    """Tokens are UTF-8 bytes (vocab 256); BOS 1, EOS 0, <think> 3, </think> 4.

    ``template=True`` gives a ChatML-like template; thinking off closes an empty
    think block in the generation prompt, like Qwen3.
    """

    bos, eos_token_ids, think_start_tokens, think_end_tokens = 1, {0}, (THINK,), (UNTHINK,)

    def __init__(self, template: bool):
        self.has_chat_template = template

    def encode(self, text, add_special_tokens=True):
        return ([self.bos] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    @property
    def detokenizer(self):
        return NaiveStreamingDetokenizer(self)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, enable_thinking=True):
        out = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return out + ("" if enable_thinking else "\x03\x04")


def fresh(target, ids, n):
    """The reference for every turn: plain greedy decoding of the target on the whole conversation,
    in fresh caches (a drafted reply equals it token for token)."""
    steps = generate_step(mx.array(ids, dtype=mx.int32), target, None, max_tokens=n, stop_token_ids=[0])
    return [t for s in steps for t in s.tokens]


def run_turn(session, text, n, B=4):
    """One turn; returns the reply tokens and the prompt ids it was generated from."""
    ids = session.render(session.messages + [{"role": "user", "content": text}])
    reply = [t for ev in session.stream(text, max_tokens=n, block_size=B) for t in ev.tokens]
    return reply, ids


def check_consistent(session):
    offsets = session.pair_cache.offsets()
    assert session.pair_cache.is_consistent(), (offsets, len(session.tokens))
    assert set(offsets["target"]) == set(offsets["drafter"]) == {len(session.tokens)}


@pytest.fixture
def pair(family):
    _, target = tiny_target(family)
    return target, tiny_drafter(target)


@pytest.mark.parametrize("template", [True, False], ids=["template", "plain"])
def test_turns_reuse_caches_exactly(pair, template):
    target, drafter = pair
    s = ChatSession(target, ByteTokenizer(template), drafter, system_prompt="be brief",
                    template_config={"enable_thinking": False})
    prev = []
    for text, n in zip(TURNS, [9, 20, 33]):
        cached = list(s.tokens)
        reply, ids = run_turn(s, text, n)
        assert reply == fresh(target, ids, n)
        check_consistent(s)
        # Both caches hold the conversation but the last token; each turn reused the
        # previous prompt (but the empty think block the template drops from history).
        assert s.tokens == (ids + reply)[:-1]
        common = common_prefix(cached, ids, len(ids) - 1)
        if common < len(cached) and isinstance(target, HybridAdapter):
            # The history changed inside the last reply (the template's think block;
            # a reply of invalid UTF-8 that re-encodes differently): a Gated-DeltaNet
            # state cannot go back that far, so the session re-prefilled everything.
            assert s.pair_cache.last_reused == 0
        else:
            assert s.pair_cache.last_reused == common >= len(prev) - 2 * template
        prev = ids
    assert [m["role"] for m in s.messages] == ["system"] + ["user", "assistant"] * 3


class RoundTripTokenizer(ByteTokenizer):
    """Every id decodes to one character that encodes back to it (ASCII for ids
    below 128, CJK above), so a reply re-renders to the very tokens generated."""

    def encode(self, text, add_special_tokens=True):
        ids = [ord(c) if ord(c) < 128 else ord(c) - 0x4E00 for c in text]
        return ([self.bos] if add_special_tokens else []) + ids

    def decode(self, ids):
        return "".join(chr(i) if i < 128 else chr(0x4E00 + i) for i in ids)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("drafted", [True, False], ids=["dflash", "plain"])
def test_hybrid_turns_reuse_the_cache(family, drafted):
    # A Gated-DeltaNet state is reused across turns when the history re-renders to
    # the cached tokens: each turn prefills only its own tokens and equals a fresh run.
    _, target = tiny_target(family)
    drafter = tiny_drafter(target) if drafted else None
    s = ChatSession(target, RoundTripTokenizer(False), drafter)
    B = 4 if drafted else None
    for i, (text, n) in enumerate(zip(TURNS, [9, 20, 33])):
        cached = len(s.tokens)
        reply, ids = run_turn(s, text, n, B=B)
        assert reply == fresh(target, ids, n)
        if drafted:
            check_consistent(s)
        assert s.pair_cache.last_reused == cached and (i == 0 or cached > 0)


def test_plain_decoding_session(family):
    _, target = tiny_target(family)
    s = ChatSession(target, ByteTokenizer(False))
    for text in TURNS[:2]:
        reply, ids = run_turn(s, text, 12, B=None)
        assert reply == fresh(target, ids, 12)
        assert set(s.pair_cache.offsets()["target"]) == {len(s.tokens)} and "drafter" not in s.pair_cache.offsets()


class Interrupt:
    """Delegates to a target, drafter or sampler and raises KeyboardInterrupt at the
    ``at``-th call, after doing the real work (so the caches have already moved)."""

    def __init__(self, inner, at):
        self.inner, self.at, self.calls = inner, at, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        return self._hit(self.inner(*args, **kwargs))

    def draft(self, *args, **kwargs):
        return self._hit(self.inner.draft(*args, **kwargs))

    def propose(self, *args, **kwargs):  # the loop drafts through propose where a drafter has it
        proposal = self.inner.propose(*args, **kwargs)
        self._hit(proposal.tokens)
        return proposal

    def _hit(self, out):
        self.calls += 1
        if self.calls == self.at:
            mx.eval(out)
            raise KeyboardInterrupt
        return out


@pytest.mark.parametrize("where", ["prefill", "verify", "draft", "sampler", "consumer"])
def test_interrupt_rolls_both_caches_back(pair, where):
    target, drafter = pair
    s = ChatSession(target, ByteTokenizer(True), drafter)
    run_turn(s, TURNS[0], 15)
    before = list(s.messages)
    sampler = None
    if where in ("prefill", "verify"):  # target forward 1 is the prefill, 4 a verify
        s.pair_cache.target = Interrupt(target, 1 if where == "prefill" else 4)
    elif where == "draft":
        s.pair_cache.drafter = Interrupt(drafter, 3)
    elif where == "sampler":
        sampler = Interrupt(lambda lp: mx.argmax(lp, axis=-1), 5)

    events = s.stream(TURNS[1], sampler=sampler, max_tokens=60, block_size=4)
    got = []
    with pytest.raises(KeyboardInterrupt):
        for ev in events:
            got += ev.tokens
            if where == "consumer" and len(got) > 6:
                raise KeyboardInterrupt  # in the consumer: the generator is suspended
    events.close()
    s.pair_cache.target, s.pair_cache.drafter = target, drafter
    check_consistent(s)
    if where == "prefill":  # nothing generated: the turn is dropped
        assert s.messages == before and s.interrupted == 1
    else:  # the partial reply is kept; the cache holds it but its last token
        assert s.messages[-1] == {"role": "assistant", "content": s.tokenizer.decode(got)}
        assert len(got) > 0 and s.tokens[-len(got) + 1 :] == got[:-1]
    # The next turn re-prefills what is missing and is exact.
    reply, ids = run_turn(s, TURNS[2], 25)
    assert reply == fresh(target, ids, 25)
    check_consistent(s)


def test_trim_cache_evens_out_layers():
    """An interrupt mid-forward can leave layers at different offsets, or keys and
    values of different lengths inside update_and_fetch."""
    layers = [KVCache() for _ in range(3)]
    for i, c in enumerate(layers):
        c.update_and_fetch(mx.ones((1, 2, 10 + i, 4)), mx.ones((1, 2, 10 + i, 4)))
    layers[2].values = layers[2].values[..., :7, :]  # half-reallocated
    trim_cache(layers, 6)
    assert [c.offset for c in layers] == [6, 6, 6]
    layers[2].update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    assert layers[2].offset == 9 and layers[2].keys.shape[2] == layers[2].values.shape[2]


def test_reset_trims_both_caches_and_starts_the_totals_afresh(pair):
    target, drafter = pair
    s = ChatSession(target, ByteTokenizer(True), drafter, system_prompt="sys")
    first, _ = run_turn(s, TURNS[0], 20)
    second, _ = run_turn(s, TURNS[1], 20)
    assert s.turns == 2 and s.totals.generation_tokens == len(first) + len(second) > 0
    s.reset()
    assert s.messages == [{"role": "system", "content": "sys"}] and s.tokens == []
    assert s.turns == 0 and s.totals.generation_tokens == 0 and s.totals.steps == 0
    check_consistent(s)
    reply, ids = run_turn(s, TURNS[2], 20)
    assert s.pair_cache.last_reused == 0 and reply == fresh(target, ids, 20)
    # /stats after /reset counts the new conversation only.
    assert s.turns == 1 and "Turns: 1 (0 interrupted)" in s.stats_lines()
    assert f"Generation: {len(reply)} tokens" in "\n".join(s.stats_lines())


def test_context_limit(pair):
    target, drafter = pair
    s = ChatSession(target, ByteTokenizer(False), drafter, max_context=40)
    reply, ids = run_turn(s, "0123456789", 100)
    assert len(ids) + len(reply) == 40 and s.context_left <= 0
    state = (list(s.messages), list(s.tokens), s.pair_cache.offsets())
    with pytest.raises(ContextFullError, match="40 tokens"):
        s.stream("more")
    assert state == (s.messages, s.tokens, s.pair_cache.offsets())
    s.reset()
    assert len([t for ev in s.stream("again", max_tokens=5) for t in ev.tokens]) == 5


def test_bad_turns(pair):
    target, drafter = pair
    s = ChatSession(target, ByteTokenizer(False), drafter)
    with pytest.raises(Exception, match="block-size"):
        s.stream("hi", block_size=17)
    with pytest.raises(Exception, match="empty"):
        s.stream("   ")
    assert s.messages == [] and s.turns == 0


def test_reply_pieces_drafted_and_thinking():
    tok = ByteTokenizer(True)
    d = ReplyDecoder(tok)
    p1 = d.add([THINK, *b"ab"], accepted=2)  # <think>, a drafted; b the target's own
    p2 = d.add([*b"cd", UNTHINK, *b"ok", 0xC3], accepted=3)  # é split across steps
    p3 = d.add([0xA9, *b"!"], accepted=0, final=True)
    look = [(p.text, p.drafted, p.thinking) for p in p1 + p2 + p3]
    assert look == [("\x03a", True, True), ("b", False, True), ("cd\x04", True, True),
                    ("ok", False, False), ("é!", False, False)]
    assert "".join(t for t, _, _ in look) == tok.decode([THINK, *b"abcd", UNTHINK, *"oké!".encode()])
    assert starts_thinking(tok, [5, THINK]) and not starts_thinking(tok, [THINK, 9, UNTHINK])


def test_thinking_switch_changes_the_prompt(pair):
    target, drafter = pair
    s = ChatSession(target, ByteTokenizer(True), drafter)
    msgs = [{"role": "user", "content": "x"}]
    s.thinking = False
    assert s.render(msgs)[-2:] == [THINK, UNTHINK]
    s.thinking = True
    assert s.render(msgs)[-2:] != [THINK, UNTHINK] and s.thinking is True


def test_plain_text_concatenation():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Once"},
            {"role": "assistant", "content": " upon"}, {"role": "user", "content": "Then"}]
    assert plain_text(msgs) == "S\nOnce upon\nThen"


def test_save_transcript(pair, tmp_path):
    target, drafter = pair
    s = ChatSession(target, ByteTokenizer(True), drafter, system_prompt="sys")
    run_turn(s, "hello", 5)
    data = json.loads(s.save(tmp_path / "t.json", meta={"model": "m"}).read_text())
    assert data["model"] == "m" and [m["role"] for m in data["messages"]] == ["system", "user", "assistant"]
    md = s.save(tmp_path / "t.md").read_text()
    assert "## User\n\nhello" in md and "## Assistant" in md


# -- the real stories260K (plain concatenation, and with a chat template added) ----------





TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@needs_shared
@pytest.mark.parametrize("template", [False, True], ids=["plain", "template"])
def test_stories_turns_equal_fresh_runs(stories, random_drafter, tmp_path, template):
    model_dir = stories
    if template:  # the same model with a chat template in its tokenizer config
        model_dir = tmp_path / "stories-chat"
        model_dir.mkdir()
        for f in Path(stories).iterdir():
            (model_dir / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        (model_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    p = load(str(model_dir), str(random_drafter))
    s = ChatSession.from_pair(p)
    assert s.use_template == template and s.max_context == 512
    held = 0
    for text, n in [("Once upon a time", 30), ("What is a KV cache?", 45), ("Lily said", 20)]:
        ids = s.render(s.messages + [{"role": "user", "content": text}])
        events = list(s.stream(text, max_tokens=n, block_size=4))
        reply = [t for ev in events for t in ev.tokens]
        ref = generate_step(mx.array(ids, dtype=mx.int32), p.target, p.drafter, max_tokens=n, block_size=4,
                            stop_token_ids=list(p.tokenizer.eos_token_ids))
        assert reply == [t for st in ref for t in st.tokens]
        assert "".join(x.text for ev in events for x in ev.pieces) == s.messages[-1]["content"]
        # The history re-tokenizes to what was generated: all the cache is reused.
        assert s.pair_cache.last_reused == held
        held = len(s.tokens)
        check_consistent(s)


@pytest.mark.parametrize("template", [True, False], ids=["template", "plain"])
def test_stop_string_cuts_the_reply_and_keeps_caches_consistent(pair, template):
    target, drafter = pair
    s = ChatSession(target, ByteTokenizer(template), drafter)
    whole = "".join(p.text for ev in s.stream(TURNS[0], max_tokens=30, block_size=4) for p in ev.pieces)
    s.reset()
    # The first character after the start that does not occur before it: the stop string.
    k = next(i for i in range(1, len(whole)) if whole.find(whole[i]) == i and whole[i] != "\ufffd")
    stop = whole[k]
    events = list(s.stream(TURNS[0], max_tokens=30, block_size=4, stop_strings=["never there", stop]))
    shown = "".join(p.text for ev in events for p in ev.pieces)
    assert shown == whole[:k] and events[-1].finish_reason == "stop"
    assert s.messages[-1] == {"role": "assistant", "content": whole[:k]}
    check_consistent(s)
    # The tokens up to the one completing the stop string were committed; the next turn goes on.
    list(s.stream(TURNS[1], max_tokens=10, block_size=4, stop_strings=[stop]))
    check_consistent(s)
    with pytest.raises(InputError, match="stop string"):
        s.stream(TURNS[2], stop_strings=[""])


def test_reply_holds_back_a_possible_stop_start():
    d = ReplyDecoder(ByteTokenizer(True), stop_strings=["STOP"])
    assert [(p.text, p.drafted) for p in d.add([*b"abc S"], accepted=5)] == [("abc ", True)]
    assert [(p.text, p.drafted) for p in d.add([*b"Tx"], accepted=0)] == [("S", True), ("Tx", False)]
    assert [(p.text, p.drafted) for p in d.add([*b"ySTOPz"], accepted=3, final=True)] == [("y", True)]
    assert d.text() == "abc STxy"
    assert ReplyDecoder(ByteTokenizer(True)).add([*b"anything"], accepted=None)[0].text == "anything"
