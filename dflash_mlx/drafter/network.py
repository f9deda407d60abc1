"""The DFlash drafter: a small block-diffusion model conditioned on target features.

One forward ("block denoising", spec section 4) turns the block ``[t_last, MASK x (B-1)]`` and the
target's new context features into logits for the B-1 masked positions. Spec section 9 adds
sliding-window layers, and DFlash2's block convolutions (:class:`BlockConv`), scaled embeddings and
logits, and candidate selector (:class:`CandidateSelector`).

A drafter layer is written once (:class:`DrafterLayer`): :meth:`~DrafterLayer.pre` (norm, projections,
RoPE), an ``attend`` the caller passes, :meth:`~DrafterLayer.post` (output projection, MLP). Inference
of one sequence (:func:`cached_attention`), a batch (:mod:`dflash_mlx.drafter.batch`) and training
(:meth:`DFlashDrafter.block_logits`) differ only in that ``attend``, the RoPE positions and whether the
two halves run compiled.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP  # the same SwiGLU MLP and keys as the checkpoints
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import ConfigError, InputError
from ..kernels import fast_softmax
from ..kernels.block_attention import block_attention
from ..protocol import Proposal
from ..sampling import Sampling
from ..targets.caches import ContextWindowCache
from ..targets.fused import compile_enabled, rope_rows, rotate
from .config import DrafterArgs

# Where rows sit for RoPE: a first position (an int, a 0-d or an [N] int array) or rope_rows' (cos, sin).
At = Union[int, mx.array, Tuple[mx.array, mx.array]]
KV = Tuple[mx.array, mx.array]
# attend(attention module, queries [N, n_heads, B, hd], new context (keys, values), block (keys, values))
Attend = Callable[["DrafterAttention", mx.array, Optional[KV], KV], mx.array]


def rope_at(rope: nn.Module, x: mx.array, at: At) -> mx.array:
    """``rope`` applied to x [N, heads, L, hd] whose first row sits at ``at``."""
    if isinstance(at, tuple):
        return rotate(x, *at, rope.traditional)
    return rope(x, offset=at)


def positions(rope: nn.Module, ctx_start, block_start, block_size: int, compiled: bool) -> Tuple[At, At]:
    """RoPE positions of B context rows from ``ctx_start`` and the B block rows from ``block_start``
    (ints or [N] arrays): shared (cos, sin) tables where :func:`rope_rows` gives them and the step runs
    compiled; else the starts, as arrays when compiled (one trace for every position)."""
    if not compiled:
        return ctx_start, block_start
    block = rope_rows(rope, block_size, block_start)
    if block is None:
        return mx.array(ctx_start), mx.array(block_start)
    return rope_rows(rope, block_size, ctx_start), block


def masked_attention(queries: mx.array, ctx: KV, block: KV, visible: mx.array, scale: float,
                     softmax: Callable[[mx.array], mx.array] = fast_softmax.softmax) -> mx.array:
    """Block queries [N, n_heads, B, hd] over context keys, values ([N or 1, n_kv, L, hd]: one shared
    context broadcasts over the N blocks) and block keys, values [N, n_kv, B, hd], where ``visible``
    ([N, 1, B or 1, L + B] bool) allows. Scores in float32; returns [N, n_heads, B, hd]."""
    N, n_heads, B, hd = queries.shape
    n_kv, W = block[0].shape[1], visible.shape[-1]
    group = n_heads // n_kv
    q = (queries.astype(mx.float32) * scale).reshape(N, n_kv, group * B, hd)  # a query group shares its K/V
    scores = mx.concatenate([q @ ctx[0].astype(mx.float32).swapaxes(-1, -2),
                             q @ block[0].astype(mx.float32).swapaxes(-1, -2)], axis=-1)
    if visible.shape[2] > 1:
        visible = mx.broadcast_to(visible[:, :, None], (N, 1, group, B, W)).reshape(N, 1, group * B, W)
    weights = softmax(mx.where(visible, scores, -mx.inf)).astype(queries.dtype)
    L = ctx[0].shape[2]
    out = weights[..., :L] @ ctx[1] + weights[..., L:] @ block[1]
    return out.reshape(N, n_heads, B, hd)


class DrafterAttention(nn.Module):
    """Block queries over cached context K/V plus the block's own K/V. Context and block rows share
    ``k_proj``/``v_proj`` (spec section 4). A sliding layer (spec section 9) has ``window`` W."""

    def __init__(self, args: DrafterArgs, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        self.window = args.sliding_window if args.is_sliding(layer) else None
        self.causal = args.is_causal_layer(layer)
        dim, hd = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = initialize_rope(hd, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        return x.reshape(x.shape[0], x.shape[1], n, self.head_dim).transpose(0, 2, 1, 3)

    def queries(self, x: mx.array, at: At) -> mx.array:
        """[N, L, H] normed rows -> queries [N, n_heads, L, hd] with RoPE."""
        return rope_at(self.rope, self.q_norm(self._heads(self.q_proj(x), self.n_heads)), at)

    def keys_values(self, rows: mx.array, at: At) -> KV:
        """[N, L, H] rows -> keys (normed, RoPE) and values [N, n_kv, L, hd]."""
        keys = self.k_norm(self._heads(self.k_proj(rows), self.n_kv_heads))
        return rope_at(self.rope, keys, at), self._heads(self.v_proj(rows), self.n_kv_heads)

    def output(self, out: mx.array) -> mx.array:
        """[N, n_heads, B, hd] attention output -> [N, B, H] (``o_proj``)."""
        N, _, B, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, B, -1))


def cached_attention(cache, rows: int) -> Attend:
    """``attend`` for one sequence: append the first ``rows`` new context rows to ``cache``, then
    the block attention over every cached row and the block (window and causality per layer)."""

    def attend(attn: DrafterAttention, queries: mx.array, ctx: Optional[KV], block: KV) -> mx.array:
        keys, values = cache.update_and_fetch(ctx[0][:, :, :rows], ctx[1][:, :, :rows])
        return block_attention(queries, keys, values, *block, scale=attn.scale, window=attn.window,
                               causal=attn.causal)

    return attend


class BlockConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution along the block (spec section 9).

    Parameters (``layers.{i}.{attention,mlp}_conv.*``): ``base_kernel`` [2, K, H],
    ``kernel_projection.weight`` [2*K*(H/g), H]. :meth:`prepare` convolves the sublayer input with the
    first kernel, :meth:`finish` the sublayer output with the second.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size)).at[:, 0].add(1.0)  # starts as the identity
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: mx.array) -> Tuple[mx.array, mx.array]:
        """x [N, L, H] -> (convolved x [N, L, H], the second kernel [N, L, K, H/g])."""
        N, L, _ = x.shape
        dyn = self.kernel_projection(x).reshape(N, L, 2, self.kernel_size, -1)
        return self._conv(x, self.base_kernel[0], dyn[:, :, 0]), dyn[:, :, 1]

    def finish(self, y: mx.array, dyn: mx.array) -> mx.array:
        """y [N, L, H] convolved with the kernel from :meth:`prepare`."""
        return self._conv(y, self.base_kernel[1], dyn)

    def _conv(self, z: mx.array, base: mx.array, dyn: mx.array) -> mx.array:
        N, L, H = z.shape
        out = None
        for o in range(min(self.kernel_size, L)):  # taps reaching before the block add zero
            shifted = z if o == 0 else mx.concatenate([mx.zeros((N, o, H), z.dtype), z[:, : L - o]], axis=1)
            term = (base[o] + mx.repeat(dyn[:, :, o], self.group_size, axis=-1)) * shifted
            out = term if out is None else out + term
        return out


class CandidateSelector(nn.Module):
    """DFlash2's candidate selector: one coherent draft path through each position's top-k (spec
    section 9). Parameters: ``predecessor_codebook``, ``successor_codebook`` [V, r] (no ``.weight``),
    ``hidden_projection.weight`` [r, H]."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = mx.zeros((vocab_size, rank))
        self.successor_codebook = mx.zeros((vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def walk(self, hidden: mx.array, logits: mx.array, first: mx.array,
             sampling: Optional[Sampling] = None) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
        """One candidate per position, walking from ``prev`` = ``first`` ([1] int32).

        Args:
            hidden: [L, H] final normed hidden states of block rows 1..L; logits: [L, V] theirs.
            sampling: None or greedy: the argmax path; else a sample of q = softmax(score / T).

        Returns:
            ``(tokens [L] int32, candidate ids [L, k] int32, q [L, k] float32 or None when greedy)``.
        """
        k = min(self.top_k, logits.shape[-1])
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
        unary = mx.take_along_axis(logits, ids, axis=-1).astype(mx.float32)
        projected = self.hidden_projection(hidden)
        successors = self.successor_codebook[ids]  # [L, k, r]
        prev = first.reshape(())
        tokens, qs = [], []
        for p in range(logits.shape[0]):
            score = unary[p] + ((self.predecessor_codebook[prev] * projected[p]) @ successors[p].T).astype(mx.float32)
            if sampling is None or sampling.greedy:
                j = mx.argmax(score)
            else:
                log_q = sampling.log_probs(score)
                j = mx.random.categorical(log_q)
                qs.append(mx.exp(log_q))
            prev = ids[p][j]
            tokens.append(prev)
        return mx.stack(tokens), ids, (mx.stack(qs) if qs else None)


class DrafterLayer(nn.Module):
    """Pre-norm layer: KV-injected attention, then the SwiGLU MLP; with DFlash2 each half wrapped in a
    :class:`BlockConv`."""

    def __init__(self, args: DrafterArgs, layer: int = 0):
        super().__init__()
        self.self_attn = DrafterAttention(args, layer)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.conv_kernel_size:
            conv = (args.hidden_size, args.conv_kernel_size, args.conv_group_size)
            self.attention_conv, self.mlp_conv = BlockConv(*conv), BlockConv(*conv)

    def pre(self, h: mx.array, context: mx.array, ctx_at: At, block_at: At):
        """Before the attention: h [N, B, H] block rows, context [N or 1, S, H] fused context rows.

        Returns:
            ``(queries [N, n_heads, B, hd], context (keys, values), block (keys, values), dyn)``;
            ``dyn`` is the attention convolution's second kernel (None without one).
        """
        x, dyn = self.input_layernorm(h), None
        if "attention_conv" in self:
            x, dyn = self.attention_conv.prepare(x)
        attn = self.self_attn
        return attn.queries(x, block_at), attn.keys_values(context, ctx_at), attn.keys_values(x, block_at), dyn

    def post(self, h: mx.array, out: mx.array, dyn: Optional[mx.array]) -> mx.array:
        """After the attention (``out`` [N, n_heads, B, hd]): residual, then the MLP half."""
        a = self.self_attn.output(out)
        h = h + (a if dyn is None else self.attention_conv.finish(a, dyn))
        x = self.post_attention_layernorm(h)
        if "mlp_conv" not in self:
            return h + self.mlp(x)
        x, dyn = self.mlp_conv.prepare(x)
        return h + self.mlp_conv.finish(self.mlp(x), dyn)

    def __call__(self, h: mx.array, context: mx.array, ctx_at: At, block_at: At, attend: Attend,
                 compiled: bool = False) -> mx.array:
        """One layer: :meth:`pre`, ``attend``, :meth:`post`; ``compiled`` runs both halves through
        ``mx.compile`` (the layer's parameters are inputs, read at every call)."""
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
    """The drafter network; embedding and lm_head are borrowed from the target (:meth:`bind`).

    Parameters (network names; :mod:`dflash_mlx.drafter.formats` maps checkpoint names): ``fc``
    [H, K*H], ``hidden_norm`` [H], ``layers.{i}.*``, ``norm`` [H], optionally ``mask_embedding`` [H],
    and for DFlash2 ``candidate_selector.*``.

    Attributes:
        draft_window: ``(sink, window)`` context rows the full-attention layers keep
            (``--draft-window``), or None: all.
    """

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
        self._embed: Optional[Callable[[mx.array], mx.array]] = None
        self._lm_head: Optional[Callable[[mx.array], mx.array]] = None
        self.draft_window: Optional[Tuple[int, int]] = None

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def target_layer_ids(self) -> List[int]:
        return self.args.target_layer_ids

    @property
    def drafter_format(self) -> str:
        """``architectures[0]`` of the checkpoint format, e.g. ``DFlash2DraftModel``."""
        return self.args.architecture

    @property
    def samples_drafts(self) -> bool:
        """True when drafts at T > 0 are samples of a real q (the DFlash2 selector); v1 drafts stay argmax."""
        return "candidate_selector" in self

    @property
    def compilable(self) -> bool:
        """Whether the layers' halves run compiled (``DFLASH_COMPILE``; DFlash2's convolutions run eager)."""
        return compile_enabled() and not self.args.conv_kernel_size

    def bind(self, embed: Callable[[mx.array], mx.array], lm_head: Callable[[mx.array], mx.array]) -> "DFlashDrafter":
        """Borrow the target's frozen embedding (with its own scale) and head, as plain callables:
        never in ``parameters()``, never saved or trained."""
        self._embed, self._lm_head = embed, lm_head
        return self

    def set_draft_window(self, window: Optional[Tuple[int, int]]) -> None:
        """Keep only ``sink`` first and ``window`` last context rows in the full-attention layers'
        caches made afterwards (``--draft-window SINK,WINDOW``); None keeps all.

        Raises:
            InputError: sink < 0 or window < 1 (names ``--draft-window``).
        """
        if window is not None:
            sink, size = (int(v) for v in window)
            if sink < 0 or size < 1:
                raise InputError(f"--draft-window {sink},{size}: SINK must be >= 0 and WINDOW >= 1")
            window = (sink, size)
        self.draft_window = window

    def make_cache(self) -> List[object]:
        """One context-only cache per layer: a sliding layer keeps its last W-1 rows, a full layer all
        (a ``KVCache``) or, with a draft window, its sink and window rows."""
        caches = []
        for layer in self.layers:
            window = layer.self_attn.window
            if window is not None:
                caches.append(ContextWindowCache(0, max(window - 1, 1)))
            elif self.draft_window is not None:
                caches.append(ContextWindowCache(*self.draft_window))
            else:
                caches.append(KVCache())
        return caches

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
        """[N] int t_last -> [N, B] int32 blocks ``[t_last, MASK x (B-1)]``."""
        tokens = tokens.reshape(-1, 1).astype(mx.int32)
        return mx.concatenate([tokens, mx.full((tokens.shape[0], block_size - 1), self.args.mask_token_id,
                                               dtype=mx.int32)], axis=1)

    def forward(self, block: mx.array, context: mx.array, ctx_at: At, block_at: At, attends: Sequence[Attend],
                compiled: bool = False) -> mx.array:
        """Every layer (one ``attend`` each) over blocks [N, B] int32 and fused context rows
        [N or 1, S, H]; returns the final normed hidden states [N, B-1, H] of block rows 1..B-1."""
        h = self.embed_block(block)
        for layer, attend in zip(self.layers, attends):
            h = layer(h, context, ctx_at, block_at, attend, compiled)
        return self.norm(h[:, 1:])

    def hidden(self, block: mx.array, context: mx.array, cache: Sequence[object]) -> mx.array:
        """[1, B-1, H] final normed hidden states of one block; the context rows join ``cache``.
        Arguments as in :meth:`__call__`."""
        fused = self._context(context, cache)
        B, S = block.shape[1], fused.shape[1]
        compiled = self.compilable and S <= B
        if compiled:  # padded to B rows: one trace per block size
            fused = mx.concatenate([fused, mx.zeros((1, B - S, fused.shape[2]), fused.dtype)], axis=1)
        offset = cache[0].offset
        ctx_at, block_at = positions(self.layers[0].self_attn.rope, offset, offset + S, B, compiled)
        return self.forward(block, fused, ctx_at, block_at, [cached_attention(c, S) for c in cache], compiled)

    def logits(self, hidden: mx.array) -> mx.array:
        """``lm_head(hidden) * output_multiplier``, then ``cap * tanh(logits / cap)`` with
        ``final_logit_softcapping`` (DFlash2; identity for v1)."""
        logits = self._lm_head(hidden)
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        return cap * mx.tanh(logits / cap) if cap else logits

    def __call__(self, block: mx.array, context: mx.array, cache: Sequence[object]) -> mx.array:
        """One block-denoising pass (spec section 4).

        Args:
            block: [1, B] int32 ``[t_last, MASK x (B-1)]``.
            context: [1, S, K*H] new context features at ``[cache offset, cache offset + S)``.
            cache: from :meth:`make_cache`; context K/V are appended in place.

        Returns:
            [1, B-1, V] logits; row k predicts the token at block position k.
        """
        return self.logits(self.hidden(block, context, cache))

    def block_logits(self, blocks: mx.array, context: mx.array, anchors: mx.array, mask: mx.array) -> mx.array:
        """Training forward over many blocks of one sequence (spec section 6).

        Args:
            blocks: [N, B] int32, each ``[token at anchor, MASK x (B-1)]``.
            context: [1, L, K*H] target features of the whole sequence (positions 0..L-1).
            anchors: [N] int32 anchor positions (block n at ``anchors[n] + 0..B-1``).
            mask: [N, 1, B, L + B] bool (:func:`dflash_mlx.train.blocks.block_mask`).

        Returns:
            [N, B-1, V] logits for block rows 1..B-1.

        Raises:
            ConfigError: not a full-attention v1-style drafter (training covers those only).
        """
        a = self.args
        if a.format.dflash2 or any(a.is_sliding(i) or a.is_causal_layer(i) for i in range(a.num_hidden_layers)):
            raise ConfigError(f"training supports full-attention v1 drafters only, not {a.architecture} "
                              "with these layer types")
        attend: Attend = lambda attn, q, ctx, block: masked_attention(q, ctx, block, mask, attn.scale)  # noqa: E731
        fused = self.hidden_norm(self.fc(context))
        return self.logits(self.forward(blocks, fused, 0, anchors, [attend] * len(self.layers)))

    def batch_drafts(self):
        """A :class:`~dflash_mlx.drafter.batch.BatchDrafts`, or None when this drafter's layers have
        no batched form (:func:`~dflash_mlx.drafter.batch.batch_drafting_refusal`)."""
        from .batch import BatchDrafts, batch_drafting_refusal

        return BatchDrafts(self) if batch_drafting_refusal(self) is None else None

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
                sampling: Optional[Sampling] = None) -> Proposal:
        """Drafts for one block with the distribution they come from (one pass, spec section 9).

        Args:
            token: scalar or [1] int ``t_last``; context: [1, S, K*H] new context features.
            cache: drafter cache; block_size: B, 2 <= B <= the trained block size.
            sampling: None: greedy. v1 drafts are the argmax at any temperature; DFlash2 drafts walk
                the selector (its argmax path, or at T > 0 a sample of its q).

        Returns:
            :class:`~dflash_mlx.protocol.Proposal` (lazy), with per-position ``logprobs`` [B-1, V].
        """
        block = self.blocks_of(mx.array(token), block_size)
        hidden = self.hidden(block, context, cache)[0]
        logits = self.logits(hidden)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if not self.samples_drafts:
            return Proposal(mx.argmax(logits, axis=-1).astype(mx.int32), logprobs=logprobs)
        tokens, ids, q = self.candidate_selector.walk(hidden, logits, block[0, :1], sampling)
        return Proposal(tokens, q_ids=None if q is None else ids, q_probs=q, logprobs=logprobs)
