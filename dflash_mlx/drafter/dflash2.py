"""DFlash2's pieces (spec section 9): the block convolution around each half of a layer and the
candidate selector that walks one draft path; :class:`~dflash_mlx.drafter.network.DrafterLayer` and
:class:`~dflash_mlx.drafter.network.DFlashDrafter` use them."""

from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..sampling import Sampling, draw_path


class BlockConv(nn.Module):
    """Grouped dynamic causal convolution along the block: ``base_kernel`` [2, K, H],
    ``kernel_projection.weight`` [2*K*(H/g), H]; :meth:`prepare` convolves a sublayer's input with the
    first kernel, :meth:`finish` its output with the second."""

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
    """One draft path through each position's top-k: ``predecessor_codebook``, ``successor_codebook``
    [V, r] (no ``.weight``), ``hidden_projection.weight`` [r, H]."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = mx.zeros((vocab_size, rank))
        self.successor_codebook = mx.zeros((vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def walk(self, hidden: mx.array, logits: mx.array, first: mx.array, sampling: Optional[Sampling] = None,
             key: Optional[mx.array] = None) -> Tuple[mx.array, Optional[mx.array]]:
        """One candidate per position from hidden [L, H] and logits [L, V] of block rows 1..L, walking
        from ``first`` ([1] int32): the argmax path (``sampling`` None or greedy) or samples of q (with ``key``).
        Returns ``(tokens [L] int32, q [L, V] float32 (zero off the top-k candidates) or None)``."""
        k = min(self.top_k, logits.shape[-1])
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
        unary = mx.take_along_axis(logits, ids, axis=-1).astype(mx.float32)
        projected = self.hidden_projection(hidden)
        successors = self.successor_codebook[ids]  # [L, k, r]

        def score(p: int, prev: mx.array) -> mx.array:
            return unary[p] + ((self.predecessor_codebook[prev] * projected[p]) @ successors[p].T).astype(mx.float32)

        tokens, q = draw_path(score, first.reshape(()), logits.shape[0], sampling, key, ids)
        return tokens, None if q is None else mx.put_along_axis(mx.zeros(logits.shape, mx.float32), ids, q, axis=-1)
