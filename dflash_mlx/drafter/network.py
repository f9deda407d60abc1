"""The DFlash drafter (spec section 4; sliding layers and DFlash2, spec section 9; DSpark, Gemma 4's, section 11).

A layer is :meth:`DrafterLayer.pre` (norm, projections, RoPE), an ``attend`` the caller passes, then
:meth:`DrafterLayer.post` (output projection, MLP). One sequence (:func:`cached_attention`), a batch
(:mod:`dflash_mlx.drafter.batch`) and training (:meth:`DFlashDrafter.block_logits`) differ only in that
``attend``, the RoPE positions and whether the two halves run compiled.
"""

from typing import Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.gemma4_text import logit_softcap

from ..errors import ConfigError, InputError
from ..kernels.block_attention import attention_path, block_attention, masked_attention
from ..protocol import Proposal
from ..sampling import Sampling, draw_path
from ..prompt_cache.drafter_context import ContextWindowCache
from ..targets.fused import compile_enabled, rope_rows, rotate
from .config import DrafterArgs
from .dflash2 import BlockConv, CandidateSelector
from .layers import ATTENTION, LAYER, adopt, mlx_lm_layer
from .vocab import draft_vocab_head, to_vocab

# Where rows sit for RoPE: a first position (an int, a 0-d or an [N] int array) or rope_rows' (cos, sin).
At = Union[int, mx.array, Tuple[mx.array, mx.array]]
KV = Tuple[mx.array, mx.array]
# attend(attention module, queries [N, n_heads, B, hd], new context (keys, values), block (keys, values))
Attend = Callable[["DrafterAttention", mx.array, KV, KV], mx.array]


def rope_at(rope: nn.Module, x: mx.array, at: At) -> mx.array:
    """``rope`` applied to x [N, heads, L, hd] whose first row sits at ``at``."""
    return rotate(x, *at, rope.traditional) if isinstance(at, tuple) else rope(x, offset=at)


class DrafterAttention(nn.Module):
    """Context and block rows share ``k_proj``/``v_proj`` (spec section 4); a sliding layer has ``window`` W; the
    projections, norms and RoPE are those of mlx-lm's attention ``theirs`` (:mod:`~dflash_mlx.drafter.layers`)."""

    def __init__(self, args: DrafterArgs, layer: int, theirs: nn.Module):
        super().__init__()
        self.window = args.sliding_window if args.is_sliding(layer) else None
        self.causal = args.is_causal_layer(layer)
        adopt(self, theirs, ATTENTION)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        return x.reshape(x.shape[0], x.shape[1], n, x.shape[-1] // n).transpose(0, 2, 1, 3)

    def queries(self, x: mx.array, at: At) -> mx.array:
        """[N, L, H] normed rows -> queries [N, n_heads, L, hd] with RoPE."""
        return rope_at(self.rope, self.q_norm(self._heads(self.q_proj(x), self.n_heads)), at)

    def keys_values(self, rows: mx.array, at: At) -> KV:
        """[N, L, H] rows -> keys (normed, RoPE) and values [N, n_kv, L, hd] (Gemma 4: ``v_norm``ed, k_proj's without v_proj)."""
        keys = self._heads(self.k_proj(rows), self.n_kv_heads)
        values = self._heads(self.v_proj(rows), self.n_kv_heads) if "v_proj" in self else keys
        values = self.v_norm(values) if "v_norm" in self else values
        return rope_at(self.rope, self.k_norm(keys), at), values

    def output(self, out: mx.array) -> mx.array:
        """[N, n_heads, B, hd] attention output -> [N, B, H] (``o_proj``)."""
        N, _, B, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, B, -1))


def cached_attention(cache, rows: int) -> Attend:
    """``attend`` for one sequence: append the first ``rows`` new context rows to ``cache``, then
    the block attention over every cached row and the block (window and causality per layer)."""

    def attend(attn: DrafterAttention, queries: mx.array, ctx: KV, block: KV) -> mx.array:
        keys, values = cache.update_and_fetch(ctx[0][:, :, :rows], ctx[1][:, :, :rows])
        attn.__dict__["path"] = attention_path(queries, keys, values, *block)  # not module state
        return block_attention(queries, keys, values, *block, scale=attn.scale, window=attn.window, causal=attn.causal)

    return attend


class DrafterLayer(nn.Module):
    """Pre-norm layer of mlx-lm's pieces (:mod:`~dflash_mlx.drafter.layers`): KV-injected attention, then the SwiGLU
    MLP; with DFlash2 each half wrapped in a :class:`BlockConv`; Gemma 4's: each half's output normed, GeGLU, scaled."""

    def __init__(self, args: DrafterArgs, layer: int = 0):
        super().__init__()
        theirs = mlx_lm_layer(args)
        self.self_attn = DrafterAttention(args, layer, theirs.self_attn)
        adopt(self, theirs, LAYER)
        if args.conv_kernel_size:
            conv = (args.hidden_size, args.conv_kernel_size, args.conv_group_size)
            self.attention_conv, self.mlp_conv = BlockConv(*conv), BlockConv(*conv)

    def pre(self, h: mx.array, context: mx.array, ctx_at: At, block_at: At):
        """h [N, B, H] block rows, context [N or 1, S, H] fused rows -> ``(queries [N, n_heads, B, hd],
        context (keys, values), block (keys, values), dyn)``; dyn: the attention convolution's (or None)."""
        x, dyn = self.input_layernorm(h), None
        if "attention_conv" in self:
            x, dyn = self.attention_conv.prepare(x)
        attn = self.self_attn
        return attn.queries(x, block_at), attn.keys_values(context, ctx_at), attn.keys_values(x, block_at), dyn

    def post(self, h: mx.array, out: mx.array, dyn: Optional[mx.array]) -> mx.array:
        """After the attention (``out`` [N, n_heads, B, hd]): residual, then the MLP half."""
        a = self.self_attn.output(out)
        if "layer_scalar" in self:  # Gemma 4
            h = h + self.post_attention_layernorm(a)
            return (h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))) * self.layer_scalar
        h = h + (a if dyn is None else self.attention_conv.finish(a, dyn))
        x = self.post_attention_layernorm(h)
        if "mlp_conv" not in self:
            return h + self.mlp(x)
        x, dyn = self.mlp_conv.prepare(x)
        return h + self.mlp_conv.finish(self.mlp(x), dyn)

    def __call__(self, h: mx.array, context: mx.array, ctx_at: At, block_at: At, attend: Attend,
                 compiled: bool = False) -> mx.array:
        """:meth:`pre`, ``attend``, :meth:`post`; ``compiled``: both halves through ``mx.compile``."""
        pre, post = self.pre, self.post
        if compiled:
            kernels = self.__dict__.get("_compiled")  # outside the module tree: never saved or trained
            if kernels is None:
                kernels = self.__dict__["_compiled"] = (mx.compile(self.pre, inputs=self.state),
                                                        mx.compile(self.post, inputs=self.state))
            pre, post = kernels
        queries, ctx, block, dyn = pre(h, context, ctx_at, block_at)
        return post(h, attend(self.self_attn, queries, ctx, block), dyn)


class DFlashDrafter(nn.Module):
    """The drafter network: ``fc`` [H, K*H], ``hidden_norm`` [H], ``layers.{i}.*``, ``norm`` [H], optionally
    ``mask_embedding`` [H], ``candidate_selector.*``, DSpark's ``embed_tokens`` [V, H], ``lm_head`` [V, H],
    ``markov_head.*`` and ``confidence_head.proj`` ([1, H (+ r)], bias [1]); embedding and lm_head borrowed
    (:meth:`bind`). ``draft_window``: ``(sink, window)`` context rows full-attention layers keep, or None: all."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(len(args.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DrafterLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.mask_embedding:
            self.mask_embedding = mx.zeros((args.hidden_size,))
        if args.selector_rank:
            self.candidate_selector = CandidateSelector(args.hidden_size, args.vocab_size,
                                                        args.selector_rank, args.selector_top_k)
        if args.format.stores_embeddings:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.markov_rank:  # DSpark's: markov_w1 [V, r] embeds the previous token, markov_w2 [V, r] maps r -> V
            self.markov_head = {"markov_w1": nn.Embedding(args.vocab_size, args.markov_rank),
                                "markov_w2": nn.Linear(args.markov_rank, args.vocab_size, bias=False)}
        if args.draft_vocab_size:  # EAGLE-3's map: draft token i is target token i + d2t[i] (drafting only)
            self.d2t = mx.zeros((args.draft_vocab_size,), mx.int64)
        if args.enable_confidence_head:  # per row a logit of 1 - TV(draft, target) from [hidden; markov_w1[prev]]
            features = args.hidden_size + args.confidence_head_with_markov * args.markov_rank
            self.confidence_head = {"proj": nn.Linear(features, 1)}  # trained, not used in decoding yet
        self.first_row = 0 if args.format.anchor_first else 1  # the first block row that drafts
        self._embed: Optional[Callable[[mx.array], mx.array]] = None
        self._lm_head: Optional[Callable[[mx.array], mx.array]] = None
        self._draft_ids: Optional[mx.array] = None  # the draft vocabulary's token ids (bind), None: all
        self._logit_cap: Optional[float] = None  # the target's final_logit_softcapping (bind)
        self.draft_window: Optional[Tuple[int, int]] = None

    @property
    def block_size(self) -> int:
        """Tokens per verify, the anchor included: the trained block, one more when row 0 drafts too."""
        return self.args.block_size + 1 - self.first_row

    @property
    def target_layer_ids(self) -> List[int]:
        return self.args.target_layer_ids

    @property
    def drafter_format(self) -> str:
        """``architectures[0]`` of the checkpoint format, e.g. ``DFlash2DraftModel``."""
        return self.args.architecture

    def attention_path(self) -> dict:
        """:func:`~dflash_mlx.kernels.block_attention.attention_path` of the latest draft (before any: the environment's)."""
        return self.layers[0].self_attn.__dict__.get("path") or attention_path()

    @property
    def samples_drafts(self) -> bool:
        """True when drafts at T > 0 are samples of a real q (the DFlash2 selector, the Markov head); v1 drafts
        stay argmax."""
        return "candidate_selector" in self or "markov_head" in self

    def bind(self, embed: Callable[[mx.array], mx.array], lm_head: Callable[[mx.array], mx.array],
             logit_cap: Optional[float] = None) -> "DFlashDrafter":
        """Borrow the target's frozen embedding (with its scale) and linear head, and its ``final_logit_softcapping``
        ``logit_cap`` (:meth:`logits` applies it): not parameters, never saved. A drafter
        that stores copies (DSpark) drops each copy equal, value for value, to what the target's gives (every
        token's embedding; the head's logits of 16 random vectors, where those of every unit vector would cost a
        whole matmul of the head), and keeps using its own where they differ. A ``d2t`` map restricts the head
        (:func:`~dflash_mlx.drafter.vocab.draft_vocab_head`; :meth:`logits` places its columns)."""
        own, a = {name: self[name] for name in ("embed_tokens", "lm_head") if name in self}, self.args
        if a.format.gemma4 and "embed_tokens" in own:  # as the target computes it: Gemma 4's times sqrt(hidden_size)
            own["embed_tokens"] = lambda ids, table=own["embed_tokens"]: table(ids) * a.hidden_size**0.5
        x = mx.random.normal((1, 16, a.hidden_size), key=mx.random.key(0)).astype(self.norm.weight.dtype)
        probes = {"embed_tokens": (embed, mx.arange(a.vocab_size)[None]), "lm_head": (lm_head, x)}
        for name, (theirs, probe) in probes.items():
            pieces = mx.split(probe, list(range(256, probe.shape[1], 256)), axis=1)  # 256 rows at a time
            if name in own and all(mx.array_equal(own[name](x), theirs(x)).item() for x in pieces):
                self.__dict__.setdefault("copies", {})[name] = self.pop(name)  # not trained; saved again
                del own[name]
        self._embed, self._lm_head = own.get("embed_tokens", embed), own.get("lm_head", lm_head)
        ids = mx.arange(self.d2t.size) + self.d2t if "d2t" in self else None
        self.__dict__["_draft_ids"], self.__dict__["_logit_cap"] = ids, logit_cap  # not module state: never saved
        if ids is not None:  # FR-Spec: the head's rows of the draft vocabulary only
            mx.eval(ids)  # not left lazy on this thread's stream (serve decodes in another)
            self._lm_head = draft_vocab_head(self._lm_head, ids, a.hidden_size, self.norm.weight.dtype)
        return self

    def set_draft_window(self, window: Optional[Tuple[int, int]]) -> None:
        """``draft_window`` of caches made afterwards; InputError (names ``--draft-window``) for sink < 0
        or window < 1."""
        if window is not None:
            sink, size = (int(v) for v in window)
            if sink < 0 or size < 1:
                raise InputError(f"--draft-window {sink},{size}: SINK must be >= 0 and WINDOW >= 1")
            window = (sink, size)
        self.draft_window = window

    def make_cache(self) -> List[object]:
        """One context-only cache per layer: a sliding layer keeps its last W-1 rows, a full layer all
        (a ``KVCache``) or, with a draft window, its sink and window rows."""
        windows = [layer.self_attn.window for layer in self.layers]
        return [ContextWindowCache(0, max(w - 1, 1)) if w is not None else
                KVCache() if self.draft_window is None else ContextWindowCache(*self.draft_window) for w in windows]

    def _context(self, context: mx.array, cache: Sequence[object]) -> mx.array:
        """Fused context rows ``hidden_norm(fc(features))`` [1, S', H] of the rows some layer will
        see (spec section 3); rows no layer's cache keeps are skipped, the caches advanced past them."""
        S = context.shape[1]
        ranges = [c.invisible(S) if isinstance(c, ContextWindowCache) else (0, 0) for c in cache]
        lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
        if hi > lo:
            if lo:
                self.ingest(context[:, :lo], cache)
            for c in cache:
                c.skip(hi - lo)
            context = context[:, hi:]
        return self.hidden_norm(self.fc(context))

    def embed_block(self, block: mx.array) -> mx.array:
        """[N, B] int32 block tokens -> [N, B, H]: the target's embedding (the drafter's own
        ``mask_embedding`` at ``mask_token_id``), times ``input_embedding_scale``."""
        if self._embed is None:
            raise RuntimeError("DFlashDrafter.bind(...) must be called before use")
        h = self._embed(block)
        if "mask_embedding" in self:
            h = mx.where((block == self.args.mask_token_id)[..., None], self.mask_embedding.astype(h.dtype), h)
        scale = self.args.input_embedding_scale
        return h if scale == 1.0 else h * scale

    def blocks_of(self, tokens: mx.array, block_size: int) -> mx.array:
        """[N] int t_last -> [N, B] int32 blocks ``[t_last, MASK x (B-1)]`` that draft a verify of ``block_size``
        (B = block_size, or B = block_size - 1 where row 0 drafts too)."""
        tokens = tokens.reshape(-1, 1).astype(mx.int32)
        masks = block_size - 2 + self.first_row
        return mx.concatenate([tokens, mx.full((tokens.shape[0], masks), self.args.mask_token_id, dtype=mx.int32)], 1)

    def forward(self, block: mx.array, context: mx.array, ctx_at: At, block_at: At, attends: Sequence[Attend],
                compile: bool = True, residual: bool = False) -> mx.array:
        """Every layer (one ``attend`` each) over blocks [N, B] int32 at ``block_at`` and fused context rows [N or 1, S,
        H] at ``ctx_at``; returns the final normed hidden states [N, D, H] of the drafting rows (``first_row`` on). With
        ``compile`` and S <= P (the verify size: B, or B + 1 where row 0 drafts), the rows are padded to P (one trace
        per shape) and both halves of each layer run compiled (not DFlash2's), RoPE by tables where :func:`rope_rows`
        gives them. ``residual``: the residual stream before the final norm instead."""
        B, S = block.shape[1], context.shape[1]
        P = B + 1 - self.first_row
        compiled = compile and compile_enabled() and not self.args.conv_kernel_size and S <= P
        if compiled:
            context = mx.pad(context, [(0, 0), (0, P - S), (0, 0)])
            rope = self.layers[0].self_attn.rope
            tables = rope_rows(rope, B, block_at)
            if tables is None:
                ctx_at, block_at = mx.array(ctx_at), mx.array(block_at)
            else:
                ctx_at, block_at = rope_rows(rope, P, ctx_at), tables
        h = self.embed_block(block)
        for layer, attend in zip(self.layers, attends):
            h = layer(h, context, ctx_at, block_at, attend, compiled)
        h = h[:, self.first_row:]
        return h if residual else self.norm(h)

    def hidden(self, block: mx.array, context: mx.array, cache: Sequence[object]) -> mx.array:
        """[1, D, H] final normed hidden states of one block's drafting rows (arguments as in :meth:`__call__`)."""
        fused = self._context(context, cache)
        S, offset = fused.shape[1], cache[0].offset
        return self.forward(block, fused, offset, offset + S, [cached_attention(c, S) for c in cache])

    def logits(self, hidden: mx.array) -> mx.array:
        """``lm_head(hidden)`` capped as the target caps (bind's ``logit_cap``), ``* output_multiplier``, then
        ``cap * tanh(logits / cap)`` with the drafter's ``final_logit_softcapping`` (DFlash2; Gemma 4 DSpark's in
        place of the target's; identity for v1); [..., V], -inf outside a draft vocabulary."""
        logits = self._lm_head(hidden)
        if self._logit_cap and not self.args.format.gemma4:  # the target's cap (Gemma 4 DSpark's: its own, below)
            logits = logit_softcap(self._logit_cap, logits)
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        logits = logit_softcap(cap, logits) if cap else logits
        return logits if self._draft_ids is None else to_vocab(logits, self._draft_ids, self.args.vocab_size)

    def __call__(self, block: mx.array, context: mx.array, cache: Sequence[object]) -> mx.array:
        """One block-denoising pass (spec section 4): block [1, B] int32 ``[t_last, MASK x (B-1)]`` and new
        context features [1, S, K*H] (appended to ``cache``) -> [1, D, V] logits of the drafting rows (rows
        1..B-1, D = B-1; all B where row 0 drafts, before the Markov head's bias)."""
        return self.logits(self.hidden(block, context, cache))

    def block_hidden(self, blocks: mx.array, context: mx.array, anchors: mx.array, mask: mx.array,
                     residual: bool = False) -> mx.array:
        """Training forward (spec section 6): blocks [N, B] int32 at ``anchors`` [N], features [1, L, K*H]
        of the sequence, ``mask`` [N, 1, B, L + B] bool (:func:`dflash_mlx.train.blocks.block_mask`) ->
        [N, B-1, H] final hidden states of the drafting rows (rows 1..B-1; where row 0 drafts, the first B-1
        rows and columns of the block and mask are used); ``residual``: before the final norm. ConfigError for
        drafters other than full-attention v1 and DSpark ones."""
        a = self.args
        if a.selector_rank or any(a.is_sliding(i) or a.is_causal_layer(i) for i in range(a.num_hidden_layers)):
            raise ConfigError(f"training supports full-attention v1 and DSpark drafters only, not {a.architecture} "
                              "with these layer types or its candidate selector")
        R = blocks.shape[1] - 1 + self.first_row
        blocks, mask = blocks[:, :R], mask[:, :, :R, : mask.shape[-1] - blocks.shape[1] + R]
        attend: Attend = lambda attn, q, ctx, block: masked_attention(q, ctx, block, mask, attn.scale)  # noqa: E731
        fused = self.hidden_norm(self.fc(context))
        return self.forward(blocks, fused, 0, anchors, [attend] * len(self.layers), compile=False, residual=residual)

    def block_logits(self, blocks: mx.array, context: mx.array, anchors: mx.array, mask: mx.array,
                     previous: Optional[mx.array] = None, hidden: Optional[mx.array] = None) -> mx.array:
        """:meth:`block_hidden` (or its ``hidden`` when given) through the head: [N, B-1, V] logits; a Markov
        head's bias added from each row's true ``previous`` token [N, B-1] (teacher forced, as training sees
        them: :func:`dflash_mlx.train.blocks.previous_tokens`)."""
        logits = self.logits(self.block_hidden(blocks, context, anchors, mask) if hidden is None else hidden)
        return logits + self.markov_bias(previous) if "markov_head" in self else logits

    def confidence(self, hidden: mx.array, previous: mx.array) -> mx.array:
        """DSpark's confidence logits [...] (spec section 11: a prediction of 1 - TV(draft, target)) of drafting
        rows' hidden states [..., H] whose previous tokens are ``previous`` [...] int32."""
        if self.args.confidence_head_with_markov and "markov_head" in self:
            hidden = mx.concatenate([hidden, self.markov_head["markov_w1"](previous).astype(hidden.dtype)], axis=-1)
        return self.confidence_head["proj"](hidden)[..., 0].astype(mx.float32)

    def markov_bias(self, previous: mx.array, columns: Optional[mx.array] = None) -> mx.array:
        """DSpark's Markov bias ``markov_w2(markov_w1[previous])`` (spec section 11): [..., V] float32 for
        tokens [...] int32, or [..., C] for vocabulary ``columns`` [C] only (float weights)."""
        w1, w2 = self.markov_head["markov_w1"], self.markov_head["markov_w2"]
        z = w1(previous[..., None])[..., 0, :]  # a quantized embedding takes no scalar index
        return (w2(z) if columns is None else z @ w2.weight[columns].T).astype(mx.float32)

    def ingest(self, context: mx.array, cache: Sequence[object]) -> None:
        """Cache context rows [1, S, K*H] without drafting, so the drafter covers what the target cache covers."""
        if context.shape[1] == 0:
            return
        fused = self._context(context, cache)
        for layer, c in zip(self.layers, cache):
            c.update_and_fetch(*layer.self_attn.keys_values(fused, c.offset))

    def draft(self, token: mx.array, context: mx.array, cache: Sequence[object], block_size: int) -> mx.array:
        """Greedy drafts [B-1] int32 (lazy) of :meth:`propose`."""
        return self.propose(token, context, cache, block_size).tokens

    def propose(self, token: mx.array, context: mx.array, cache: Sequence[object], block_size: int,
                sampling: Optional[Sampling] = None, key: Optional[mx.array] = None) -> Proposal:
        """Drafts of one verify of ``block_size`` (``t_last`` a scalar or [1] int, context [1, S, K*H],
        2 <= B <= :attr:`block_size`) as a lazy :class:`~dflash_mlx.protocol.Proposal` with ``logprobs`` [B-1, V]
        (before any walk): :meth:`drafts`, at T > 0 with ``sampling`` a sample of its q drawn with ``key``."""
        block = self.blocks_of(mx.array(token), block_size)
        hidden = self.hidden(block, context, cache)[0]
        logits = self.logits(hidden)
        tokens, q = self.drafts(hidden, logits, block[0, 0], sampling, key)
        inside = logits if self._draft_ids is None else logits[..., self._draft_ids]  # the rest is -inf: adds 0
        return Proposal(tokens, q, logits - mx.logsumexp(inside, axis=-1, keepdims=True))

    def drafts(self, hidden: mx.array, logits: mx.array, first: mx.array, sampling: Optional[Sampling] = None,
               key: Optional[mx.array] = None) -> Tuple[mx.array, Optional[mx.array]]:
        """The drafts of the drafting rows' hidden states [..., D, H] and logits [..., D, V] after ``first``
        [...] int32 (t_last): the argmax for v1; a walk for DFlash2 (its selector, spec section 9; one block) and
        DSpark (section 11: row k's logits plus the Markov head's bias ``markov_w2(markov_w1[prev])`` of the
        token drafted before it, ``first`` before row 0), the argmax or at T > 0 a sample of that q (``sampling``,
        ``key``). Returns ``(tokens [..., D] int32, q [..., D, V] float32 or None)``."""
        if "candidate_selector" in self:
            return self.candidate_selector.walk(hidden, logits, first, sampling, key)
        if "markov_head" not in self:
            return mx.argmax(logits, axis=-1).astype(mx.int32), None
        return draw_path(lambda p, prev: logits[..., p, :].astype(mx.float32) + self.markov_bias(prev),
                         first, logits.shape[-2], sampling, key)
