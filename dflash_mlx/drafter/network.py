# Over 400 lines: the drafter network in one file, as the method is read (attention, layers, DFlash2 pieces, drafting)
"""The DFlash drafter: a small block-diffusion model conditioned on target features.

One forward pass ("block denoising", DFLASH_SPEC.md section 4) turns the block
``[t_last, MASK x (B-1)]`` plus the target's new context features into logits for
the B-1 masked positions. The newer formats (spec section 9) add, in this file:

- sliding-window layers: a layer keeps the last W-1 context rows and its block
  queries see keys less than W positions back, causal inside the block
  (:func:`~dflash_mlx.kernels.block_attention.block_attention`,
  :class:`~dflash_mlx.prompt_cache.trim.ContextWindowCache`);
- DFlash2: a grouped dynamic causal convolution around attention and MLP
  (:class:`BlockConv`), scaled embeddings, scaled and soft-capped logits, and a
  candidate selector that walks one coherent path through each position's top-k
  (:class:`CandidateSelector`).

Which format a checkpoint is, and its key names, is :mod:`dflash_mlx.drafter.formats`;
hyper-parameters :mod:`dflash_mlx.drafter.config`; loading and saving
:mod:`dflash_mlx.drafter.checkpoint`.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP  # the same SwiGLU MLP and keys as the checkpoints
from mlx_lm.models.rope_utils import initialize_rope

from ..prompt_cache.drafter_context import ContextWindowCache
from ..targets.fused import compile_enabled, rope_rows, rotate  # shared with the target's fused layers
from .config import DrafterArgs
from ..errors import ConfigError, InputError
from ..kernels import fast_softmax
from ..kernels.block_attention import block_attention
from ..protocol import Proposal
from ..sampling import Sampling


class DrafterAttention(nn.Module):
    """Block queries over cached context K/V plus the block's own K/V.

    Context and block rows share ``k_proj``/``v_proj`` (KV injection, spec section 4).
    A sliding layer (spec section 9) has ``window`` W and, by default, causal in-block
    attention.
    """

    def __init__(self, args: DrafterArgs, layer: int = 0):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
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
        self.rope = initialize_rope(
            hd, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
        )

    def _heads(self, x: mx.array, n: int) -> mx.array:
        return x.reshape(x.shape[0], x.shape[1], n, -1).transpose(0, 2, 1, 3)

    def _keys_values(self, rows: mx.array):
        """Shared K/V projections of context and block rows: normed keys, values (no RoPE)."""
        keys = self.k_norm(self._heads(self.k_proj(rows), self.n_kv_heads))
        return keys, self._heads(self.v_proj(rows), self.n_kv_heads)

    def ingest(self, context: mx.array, cache) -> Tuple[mx.array, mx.array]:
        """Append [1, S, H] fused context rows at ``cache.offset``; returns the cached
        context K/V the next block sees (RoPE at absolute positions)."""
        keys, values = self._keys_values(context)
        return cache.update_and_fetch(self.rope(keys, offset=cache.offset), values)

    def __call__(self, x: mx.array, context: mx.array, cache) -> mx.array:
        """Inference: x [1, B, H] block rows; context [1, S, H] new fused context rows."""
        queries, keys, values = self.project(x, context, cache.offset)
        S = context.shape[1]
        return self.output(self.attend(queries, keys[:, :, :S], values[:, :, :S], keys[:, :, S:], values[:, :, S:],
                                       cache))

    def project(self, x: mx.array, context: mx.array, offset) -> Tuple[mx.array, mx.array, mx.array]:
        """Queries of the B block rows, keys and values of the S context rows then the
        block rows, RoPE applied (context at ``offset``, an int or a 0-d array, then
        the block): ``([1, n_heads, B, hd], [1, n_kv, S + B, hd], [1, n_kv, S + B, hd])``.

        Context and block rows sit at consecutive positions, so they share one
        projection, one norm and one RoPE (fewer, larger ops: a draft is a few ms).
        """
        S = context.shape[1]
        queries = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=offset + S)
        keys, values = self._keys_values(mx.concatenate([context, x], axis=1) if S else x)
        return queries, self.rope(keys, offset=offset), values

    def attend(self, queries: mx.array, ctx_keys: mx.array, ctx_values: mx.array, block_keys: mx.array,
               block_values: mx.array, cache) -> mx.array:
        """Append the new context rows' keys and values to ``cache``; the block queries'
        attention over every cached row and the block's own rows ([1, n_heads, B, hd]):
        the Metal kernel where it can run, else the MLX reference
        (:mod:`dflash_mlx.kernels.block_attention`)."""
        ctx_keys, ctx_values = cache.update_and_fetch(ctx_keys, ctx_values)
        return block_attention(queries, ctx_keys, ctx_values, block_keys, block_values,
                               scale=self.scale, window=self.window, causal=self.causal)

    def output(self, out: mx.array) -> mx.array:
        """[1, n_heads, B, hd] attention output -> [1, B, H] (``o_proj``)."""
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(1, out.shape[2], -1))

    def blocks(self, x: mx.array, context: mx.array, anchors: mx.array, mask: mx.array) -> mx.array:
        """Training: many blocks of one sequence at once (spec section 6).

        Args:
            x: [N, B, H] block rows, block n at positions ``anchors[n] + 0..B-1``.
            context: [1, L, H] fused context rows at positions 0..L-1.
            anchors: [N] int32 anchor positions.
            mask: [N, 1, B, L + B] bool, True where a query may look (context
                columns first, then the block's own rows).

        Memory: the context K/V ([1, n_kv, L, head_dim]) is shared by every block
        through broadcasting matmuls; ``scaled_dot_product_attention`` would need one
        copy per block (N x L rows). The scores ([N, n_heads, B, L + B], float32)
        are the largest tensor here; callers bound N (the trainer's ``anchor_chunk``).
        """
        N, B, _ = x.shape
        L = context.shape[1]
        group = self.n_heads // self.n_kv_heads
        queries = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=anchors)
        block_keys, block_values = self._keys_values(x)
        block_keys = self.rope(block_keys, offset=anchors)
        ctx_keys, ctx_values = self._keys_values(context)
        ctx_keys = self.rope(ctx_keys, offset=0)
        # Row g * B + i: query head kv * group + g, block row i (GQA: a group shares its K/V).
        q = (queries.astype(mx.float32) * self.scale).reshape(N, self.n_kv_heads, group * B, self.head_dim)
        scores = mx.concatenate([q @ ctx_keys.astype(mx.float32).swapaxes(-1, -2),
                                 q @ block_keys.astype(mx.float32).swapaxes(-1, -2)], axis=-1)
        visible = mx.broadcast_to(mask[:, :, None], (N, 1, group, B, L + B)).reshape(N, 1, group * B, L + B)
        weights = fast_softmax.softmax(mx.where(visible, scores, -mx.inf)).astype(x.dtype)  # mx.softmax is slow on CPUs
        out = weights[..., :L] @ ctx_values + weights[..., L:] @ block_values  # [N, n_kv, group * B, hd]
        out = out.reshape(N, self.n_heads, B, self.head_dim)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, B, -1))


class BlockConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution along the block (spec section 9).

    ``conv(z, base, dyn)[p] = sum_{o<K} (base[o] + dyn[p, o, group]) * z[p - o]`` with
    ``z[p - o] = 0`` before the block start; ``base`` is per channel, ``dyn`` per group
    of g channels (channel c is in group c // g). One projection of the sublayer input
    gives both kernels: :meth:`prepare` convolves the input with the first,
    :meth:`finish` the sublayer's output with the second.

    Parameters (checkpoint keys ``layers.{i}.{attention,mlp}_conv.*``):
    ``base_kernel`` [2, K, H], ``kernel_projection.weight`` [2*K*(H/g), H].
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        # Tap 0 = 1: a fresh convolution starts as the identity.
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size)).at[:, 0].add(1.0)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: mx.array) -> Tuple[mx.array, mx.array]:
        """x [N, L, H] -> (convolved x [N, L, H], the second kernel [N, L, K, H/g])."""
        N, L, _ = x.shape
        dyn = self.kernel_projection(x).reshape(N, L, 2, self.kernel_size, -1)
        return self._conv(x, self.base_kernel[0], dyn[:, :, 0]), dyn[:, :, 1]

    def finish(self, y: mx.array, dyn: mx.array) -> mx.array:
        """Convolve the sublayer output y [N, L, H] with the kernel from :meth:`prepare`."""
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
    """DFlash2's candidate selector: one coherent draft path through per-position top-k.

    Walking the block left to right from ``prev`` = the block's first token, candidate
    c at position p scores ``logit(c) + sum_r pred[prev, r] * hr[p, r] * succ[c, r]``
    with ``hr = hidden_projection(hidden)``; the draft is the argmax (T = 0) or a sample
    of ``q = softmax(score / T)`` over the k candidates (shaped like the target's p).

    Parameters (checkpoint keys, spec section 9): ``predecessor_codebook`` [V, r] and
    ``successor_codebook`` [V, r] (no ``.weight`` suffix), ``hidden_projection.weight`` [r, H].
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = mx.zeros((vocab_size, rank))
        self.successor_codebook = mx.zeros((vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def walk(self, hidden: mx.array, logits: mx.array, first: mx.array,
             sampling: Optional[Sampling] = None) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
        """Choose one candidate per position.

        Args:
            hidden: [L, H] final normed hidden states of block rows 1..L.
            logits: [L, V] their logits (after multiplier and softcap).
            first: [1] int32, the block's first token.
            sampling: None or greedy: argmax path; else sample each position from q.

        Returns:
            ``(tokens [L] int32, candidate ids [L, k] int32, q [L, k] float32 or None)``;
            q is the distribution each token was drawn from (None for the argmax path).
        """
        k = min(self.top_k, logits.shape[-1])
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
        unary = mx.take_along_axis(logits, ids, axis=-1).astype(mx.float32)
        projected = self.hidden_projection(hidden)
        successors = self.successor_codebook[ids]  # [L, k, r]
        prev = first.reshape(())
        tokens, qs = [], []
        for p in range(logits.shape[0]):
            pair = (self.predecessor_codebook[prev] * projected[p]) @ successors[p].T  # [k]
            score = unary[p] + pair.astype(mx.float32)
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
    """Pre-norm transformer layer: KV-injected attention, then SwiGLU MLP; with
    DFlash2, each half wrapped in a :class:`BlockConv`."""

    def __init__(self, args: DrafterArgs, layer: int = 0):
        super().__init__()
        self.self_attn = DrafterAttention(args, layer)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.conv_kernel_size:
            conv = (args.hidden_size, args.conv_kernel_size, args.conv_group_size)
            self.attention_conv, self.mlp_conv = BlockConv(*conv), BlockConv(*conv)

    def _wrapped(self, name: str, fn: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
        """``fn(x)``, or ``finish(fn(prepare(x)))`` through the layer's BlockConv ``name``."""
        conv = self.get(name)
        if conv is None:
            return fn(x)
        x, dyn = conv.prepare(x)
        return conv.finish(fn(x), dyn)

    def __call__(self, h: mx.array, context: mx.array, cache=None,
                 anchors: Optional[mx.array] = None, mask: Optional[mx.array] = None) -> mx.array:
        """Inference with ``cache``; training with ``anchors`` and ``mask`` instead."""
        if cache is not None and "attention_conv" not in self and context.shape[1] <= h.shape[1] \
                and compile_enabled():
            return self._compiled_step(h, context, cache)
        if cache is not None:
            attend = lambda x: self.self_attn(x, context, cache)  # noqa: E731
        else:
            attend = lambda x: self.self_attn.blocks(x, context, anchors, mask)  # noqa: E731
        h = h + self._wrapped("attention_conv", attend, self.input_layernorm(h))
        return h + self._wrapped("mlp_conv", self.mlp, self.post_attention_layernorm(h))


    def _compiled_step(self, h: mx.array, context: mx.array, cache) -> mx.array:
        """The inference step with its two fixed-shape halves compiled (MLX fuses their
        element-wise ops: on a CPU, RoPE and RMSNorm are some 40 small ops each): the
        norm and projections before the attention, the output projection and the MLP
        after it. The attention between them sees a context that grows every step.

        The S <= B new context rows are padded to B, so each block size is traced
        once, not once per number of accepted drafts (a trace costs a few ms, which a
        fresh process would pay for each)."""
        kernels = self.__dict__.get("_kernels")
        if kernels is None:
            kernels = self.__dict__["_kernels"] = _LayerKernels(self)
        B, S = h.shape[1], context.shape[1]
        if S < B:
            context = mx.concatenate([context, mx.zeros((1, B - S, context.shape[2]), context.dtype)], axis=1)
        rope = self.self_attn.rope
        block_rows = rope_rows(rope, B, cache.offset + S)
        if block_rows is not None:  # RoPE tables shared by the layers (CPU): fewer ops than RoPE itself
            queries, keys, values = kernels.pre_tables(h, context, *rope_rows(rope, B, cache.offset), *block_rows)
        else:
            queries, keys, values = kernels.pre(h, context, mx.array(cache.offset, dtype=mx.int32), mx.array(S))
        out = self.self_attn.attend(queries, keys[:, :, :S], values[:, :, :S], keys[:, :, B:], values[:, :, B:],
                                    cache)
        return kernels.post(h, out)

    def _project(self, h: mx.array, context: mx.array, rope_context: Callable[[mx.array], mx.array],
                 rope_block: Callable[[mx.array], mx.array]):
        """Queries of the block, keys and values of ``context`` (B rows) then the block,
        RoPE applied by ``rope_context`` to the context rows and ``rope_block`` to the block's."""
        attn = self.self_attn
        x = self.input_layernorm(h)
        queries = rope_block(attn.q_norm(attn._heads(attn.q_proj(x), attn.n_heads)))
        keys, values = attn._keys_values(mx.concatenate([context, x], axis=1))
        P = context.shape[1]
        keys = mx.concatenate([rope_context(keys[:, :, :P]), rope_block(keys[:, :, P:])], axis=2)
        return queries, keys, values

    def _pre(self, h: mx.array, context: mx.array, offset: mx.array, rows: mx.array):
        """:meth:`_project` for ``context`` of B rows, the first ``rows`` real: context at
        ``offset``, block at ``offset + rows``."""
        rope = self.self_attn.rope
        return self._project(h, context, lambda x: rope(x, offset=offset), lambda x: rope(x, offset=offset + rows))

    def _pre_tables(self, h: mx.array, context: mx.array, ctx_cos: mx.array, ctx_sin: mx.array,
                    block_cos: mx.array, block_sin: mx.array):
        """:meth:`_pre` with RoPE as :func:`~dflash_mlx.targets.fused.rotate` by the
        positions' tables (context rows, then block rows): the same bits."""
        traditional = self.self_attn.rope.traditional
        return self._project(h, context, lambda x: rotate(x, ctx_cos, ctx_sin, traditional),
                             lambda x: rotate(x, block_cos, block_sin, traditional))

    def _post(self, h: mx.array, attention: mx.array) -> mx.array:
        h = h + self.self_attn.output(attention)
        return h + self.mlp(self.post_attention_layernorm(h))



class _LayerKernels:
    """A layer's compiled halves (:meth:`DrafterLayer._compiled_step`). The layer's
    parameters are inputs of the compiled functions, read at every call, so new
    weights (training, ``load_weights``, a dtype change) are always the ones used.
    Held outside the module's tree, so it is never saved or trained."""

    def __init__(self, layer: "DrafterLayer"):
        self.pre = mx.compile(layer._pre, inputs=layer.state)
        self.pre_tables = mx.compile(layer._pre_tables, inputs=layer.state)
        self.post = mx.compile(layer._post, inputs=layer.state)


class DFlashDrafter(nn.Module):
    """The drafter network. Embedding and lm_head are borrowed from the target.

    Parameters (network names; :mod:`dflash_mlx.drafter.formats` maps checkpoint names):
    ``fc`` [H, K*H], ``hidden_norm`` [H], ``layers.{i}.*``, ``norm`` [H], and for
    DFlash2 ``candidate_selector.*``. Call :meth:`bind` before use.

    Attributes:
        draft_window: ``(sink, window)`` context rows the full-attention layers keep
            (``--draft-window``), or None: all (the default).
    """

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        n_ctx = len(args.target_layer_ids) * args.hidden_size
        self.fc = nn.Linear(n_ctx, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DrafterLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.mask_embedding:  # a checkpoint's own row for masked positions (variants.py)
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
        """True when drafts at T > 0 are samples of a real proposal q (the DFlash2
        selector), so speculative sampling applies; v1 drafts stay argmax."""
        return "candidate_selector" in self

    def bind(self, embed: Callable[[mx.array], mx.array], lm_head: Callable[[mx.array], mx.array]) -> "DFlashDrafter":
        """Borrow the target's (frozen) embedding and output head.

        ``embed`` includes the target's own embedding scale, if any. Stored as plain
        callables, so they never appear in ``parameters()``, are never saved and are
        never trained.
        """
        self._embed, self._lm_head = embed, lm_head
        return self

    def set_draft_window(self, window: Optional[Tuple[int, int]]) -> None:
        """Keep only ``sink`` first and ``window`` last context rows in the full-attention
        layers' caches (``--draft-window SINK,WINDOW``); None keeps all. Applies to
        caches made afterwards.

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
        """One context-only cache per drafter layer: a sliding layer keeps its last
        W-1 rows, a full layer everything (a ``KVCache``) or, with a draft window,
        its sink and window rows."""
        caches = []
        for layer in self.layers:
            attn = layer.self_attn
            if attn.window is not None:
                caches.append(ContextWindowCache(0, max(attn.window - 1, 1)))
            elif self.draft_window is not None:
                caches.append(ContextWindowCache(*self.draft_window))
            else:
                caches.append(KVCache())
        return caches

    def _context(self, context: mx.array, cache: Sequence[object]) -> mx.array:
        """Fused context rows ``hidden_norm(fc(features))`` [1, S', H] of the rows some
        layer will see. Rows no layer's cache keeps (between a sink and the window,
        or before a sliding window) are skipped, not computed; caches advance past them."""
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

    def hidden(self, block: mx.array, context: mx.array, cache: Sequence[object]) -> mx.array:
        """Final normed hidden states [1, B-1, H] of block rows 1..B-1 (one pass; the
        context rows are appended to ``cache``). Arguments as in :meth:`__call__`."""
        if self._embed is None:
            raise RuntimeError("DFlashDrafter.bind(...) must be called before use")
        h = self.embed_block(block)
        if self.args.input_embedding_scale != 1.0:
            h = h * self.args.input_embedding_scale
        fused = self._context(context, cache)
        for layer, c in zip(self.layers, cache):
            h = layer(h, fused, c)
        return self.norm(h[:, 1:])

    def embed_block(self, block: mx.array) -> mx.array:
        """[N, B] int32 block tokens -> [N, B, H] embeddings: the target's, with the
        drafter's own ``mask_embedding`` row at ``mask_token_id`` positions when it has one."""
        h = self._embed(block)
        if "mask_embedding" in self:
            h = mx.where((block == self.args.mask_token_id)[..., None], self.mask_embedding.astype(h.dtype), h)
        return h

    def logits(self, hidden: mx.array) -> mx.array:
        """``lm_head(hidden) * output_multiplier``, then ``cap * tanh(logits / cap)`` when
        ``final_logit_softcapping`` is set (both DFlash2; identity for v1)."""
        logits = self._lm_head(hidden)
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        if cap:
            logits = cap * mx.tanh(logits / cap)
        return logits

    def __call__(self, block: mx.array, context: mx.array, cache: Sequence[object]) -> mx.array:
        """One block-denoising pass.

        Args:
            block: [1, B] int32, ``[t_last, MASK x (B-1)]``.
            context: [1, S, K*H] new context features (target dtype), the rows at
                positions ``[cache.offset, cache.offset + S)``; ``t_last`` sits at
                ``cache.offset + S``.
            cache: from :meth:`make_cache`; context K/V are appended in place.

        Returns:
            [1, B-1, V] logits for block positions 1..B-1 (row k predicts the
            token at block position k).
        """
        return self.logits(self.hidden(block, context, cache))

    def block_logits(self, blocks: mx.array, context: mx.array, anchors: mx.array, mask: mx.array) -> mx.array:
        """Training forward over many blocks of one sequence.

        Args:
            blocks: [N, B] int32, each ``[token at anchor, MASK x (B-1)]``.
            context: [1, L, K*H] target features of the whole sequence.
            anchors: [N] int32 anchor positions.
            mask: [N, 1, B, L + B] bool from :func:`dflash_mlx.train.blocks.block_mask`.

        Returns:
            [N, B-1, V] logits for block rows 1..B-1.

        Raises:
            ConfigError: the drafter is not a full-attention v1-style drafter (training
                covers those only).
        """
        a = self.args
        if a.format.dflash2 or any(a.is_sliding(i) or a.is_causal_layer(i) for i in range(a.num_hidden_layers)):
            raise ConfigError(f"training supports full-attention v1 drafters only, not {a.architecture} "
                              "with these layer types")
        h = self.embed_block(blocks)
        fused = self.hidden_norm(self.fc(context))
        for layer in self.layers:
            h = layer(h, fused, anchors=anchors, mask=mask)
        return self._lm_head(self.norm(h[:, 1:]))

    def batch_drafts(self):
        """A :class:`~dflash_mlx.drafter.batch.BatchDrafts` (one pass drafts a whole batch of
        sequences), or None when this drafter's layers have no batched form
        (:func:`~dflash_mlx.drafter.batch.batch_drafting_refusal`)."""
        from .batch import BatchDrafts, batch_drafting_refusal

        return BatchDrafts(self) if batch_drafting_refusal(self) is None else None

    def ingest(self, context: mx.array, cache: Sequence[object]) -> None:
        """Cache context rows without drafting, so the drafter covers what the target
        cache covers (used when a generation ends; the next turn continues from it).

        Args:
            context: [1, S, K*H] context features at positions ``[offset, offset+S)``.
        """
        if context.shape[1] == 0:
            return
        fused = self._context(context, cache)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.ingest(fused, c)

    def _block(self, token: mx.array, block_size: int) -> mx.array:
        masks = mx.full((block_size - 1,), self.args.mask_token_id, dtype=mx.int32)
        return mx.concatenate([token.reshape(1).astype(mx.int32), masks])[None]

    def draft(self, token: mx.array, context: mx.array, cache: Sequence[object], block_size: int) -> mx.array:
        """Greedy drafts for one block: the argmax (v1) or the selector's argmax path (DFlash2).

        Args:
            token: scalar or [1] int, the last committed token ``t_last``.
            context: [1, S, K*H] new context features.
            cache: drafter cache.
            block_size: B, 2 <= B <= trained block size.

        Returns:
            [B-1] int32 draft tokens d_1..d_{B-1} (lazy).
        """
        return self.propose(token, context, cache, block_size).tokens

    def propose(self, token: mx.array, context: mx.array, cache: Sequence[object], block_size: int,
                sampling: Optional[Sampling] = None) -> Proposal:
        """Drafts for one block with the distribution they come from (one pass).

        v1 drafts are the argmax at any temperature (a one-hot q: sampling a v1
        drafter per position lowers acceptance, spec section 9). DFlash2 drafts walk
        the candidate selector: its argmax path, or at T > 0 a sample of its q shaped
        by ``sampling`` as the target's p is.

        Args:
            token, context, cache, block_size: as in :meth:`draft`.
            sampling: temperature and filters (None: greedy).

        Returns:
            :class:`~dflash_mlx.protocol.Proposal` (lazy arrays), with the pass's
            per-position ``logprobs`` [B-1, V].
        """
        block = self._block(token, block_size)
        hidden = self.hidden(block, context, cache)[0]
        logits = self.logits(hidden)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if not self.samples_drafts:
            return Proposal(mx.argmax(logits, axis=-1).astype(mx.int32), logprobs=logprobs)
        tokens, ids, q = self.candidate_selector.walk(hidden, logits, block[0, :1], sampling)
        return Proposal(tokens, q_ids=None if q is None else ids, q_probs=q, logprobs=logprobs)
