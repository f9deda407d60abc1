"""The DFlash drafter: a small block-diffusion model conditioned on target features.

One forward pass ("block denoising", DFLASH_SPEC.md section 4) turns the block
``[t_last, MASK x (B-1)]`` plus the target's new context features into logits for
the B-1 masked positions. The checkpoint format is the released one
(``z-lab/*-DFlash-b16``, spec section 2): ``config.json`` with Qwen3-style keys and
``dflash_config``, and unprefixed ``model.safetensors`` without embedding or head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP  # the same SwiGLU MLP and keys as the checkpoints
from mlx_lm.models.rope_utils import initialize_rope

from .errors import CheckpointError, ConfigError
from .hub import resolve_model_path

DRAFTER_ARCHITECTURE = "DFlashDraftModel"
DRAFTER_FILES = ["*.json", "*.safetensors"]


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """Target layers spread evenly, as older checkpoints without the key assume.

    Formula (spec section 2): ``round(1 + i * (N_target - 4) / (N_draft - 1))``,
    which gives ``[1, 9, 17, 25, 33]`` for 36 target layers and 5 drafter layers.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterArgs:
    """Drafter hyper-parameters, as read from a released ``config.json``.

    Attributes:
        hidden_size: Width H; equals the target's hidden size.
        num_hidden_layers: Drafter layers.
        num_attention_heads, num_key_value_heads, head_dim: GQA shape.
        intermediate_size: SwiGLU MLP width.
        vocab_size: Equals the target's vocabulary size.
        target_layer_ids: 0-based target layers whose output is captured
            (``dflash_config.target_layer_ids``).
        mask_token_id: Unused vocabulary row used for masked block positions
            (``dflash_config.mask_token_id``).
        block_size: Trained block size B (top-level ``block_size``).
        num_target_layers: Layers of the target the drafter was trained for.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: List[int]
    mask_token_id: int
    block_size: int = 16
    num_target_layers: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> "DrafterArgs":
        """Parse and validate a drafter config.

        Raises:
            ConfigError: a required key is missing or a value is out of range; the
                message names ``source`` and the key.
        """
        def need(key: str) -> Any:
            if key not in config:
                raise ConfigError(f"{source}: missing key '{key}'")
            return config[key]

        dflash = config.get("dflash_config") or {}
        archs = config.get("architectures") or []
        if not dflash and DRAFTER_ARCHITECTURE not in archs:
            raise ConfigError(
                f"{source}: not a DFlash drafter config (no 'dflash_config' and "
                f"'architectures' is {archs}); pass the drafter folder to --draft-model"
            )
        layer_types = config.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ConfigError(
                f"{source}: 'layer_types' {sorted(set(layer_types))} is not supported yet; "
                "only full_attention drafters load"
            )
        n_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        n_layers = int(need("num_hidden_layers"))
        n_target = config.get("num_target_layers")
        layer_ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
        if layer_ids is None:
            if n_target is None:
                raise ConfigError(
                    f"{source}: missing key 'dflash_config.target_layer_ids' "
                    "(and no 'num_target_layers' to derive it)"
                )
            layer_ids = default_target_layer_ids(int(n_target), n_layers)
        mask_id = dflash.get("mask_token_id", config.get("mask_token_id"))
        if mask_id is None:
            raise ConfigError(f"{source}: missing key 'dflash_config.mask_token_id'")
        rope_params = config.get("rope_parameters") or {}
        rope_theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = config.get("rope_scaling") or (rope_params or None)
        args = cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(config.get("num_key_value_heads", n_heads)),
            head_dim=int(config.get("head_dim") or hidden // n_heads),
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            target_layer_ids=[int(i) for i in layer_ids],
            mask_token_id=int(mask_id),
            block_size=int(dflash.get("block_size", config.get("block_size", 16))),
            num_target_layers=None if n_target is None else int(n_target),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings") or 40960),
        )
        args.validate(source)
        return args

    def validate(self, source: str = "config.json") -> None:
        """Check ranges that do not need the target.

        Raises:
            ConfigError: naming ``source`` and the offending key.
        """
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"{source}: 'dflash_config.mask_token_id' {self.mask_token_id} is outside "
                f"the vocabulary [0, {self.vocab_size})"
            )
        if self.block_size < 2:
            raise ConfigError(f"{source}: 'block_size' {self.block_size} must be at least 2")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ConfigError(
                f"{source}: 'dflash_config.target_layer_ids' {self.target_layer_ids} "
                "must be a non-empty list of layer indices >= 0"
            )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "intermediate_size", "vocab_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{source}: '{key}' must be positive, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{source}: num_attention_heads {self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads {self.num_key_value_heads}"
            )

    def to_config(self, dtype: str = "bfloat16") -> dict:
        """The ``config.json`` the authors' loader reads (Qwen3Config keys)."""
        return {
            "architectures": [DRAFTER_ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
            "torch_dtype": dtype,
        }


class DrafterAttention(nn.Module):
    """Attention of block queries over cached context K/V plus the block's own K/V.

    Context and block rows share ``k_proj``/``v_proj`` (KV injection, spec section 4).
    """

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
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

    def ingest(self, context: mx.array, cache: KVCache) -> None:
        """Append context K/V only (no block): [1, S, H] fused rows at ``cache.offset``."""
        keys, values = self._keys_values(context)
        cache.update_and_fetch(self.rope(keys, offset=cache.offset), values)

    def __call__(self, x: mx.array, context: mx.array, cache: KVCache) -> mx.array:
        """Inference: x [1, B, H] block rows; context [1, S, H] new fused context rows."""
        _, B, _ = x.shape
        S = context.shape[1]
        offset = cache.offset
        keys, values = self._keys_values(mx.concatenate([context, x], axis=1))
        queries = self.q_norm(self._heads(self.q_proj(x), self.n_heads))

        queries = self.rope(queries, offset=offset + S)
        block_keys = self.rope(keys[:, :, S:], offset=offset + S)
        ctx_keys, ctx_values = cache.update_and_fetch(
            self.rope(keys[:, :, :S], offset=offset), values[:, :, :S]
        )
        keys = mx.concatenate([ctx_keys, block_keys], axis=2)
        values = mx.concatenate([ctx_values, values[:, :, S:]], axis=2)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=None
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(1, B, -1))

    def blocks(self, x: mx.array, context: mx.array, anchors: mx.array, mask: mx.array) -> mx.array:
        """Training: many blocks of one sequence at once (spec section 6).

        Args:
            x: [N, B, H] block rows, block n at positions ``anchors[n] + 0..B-1``.
            context: [1, L, H] fused context rows at positions 0..L-1.
            anchors: [N] int32 anchor positions.
            mask: [N, 1, B, L + B] bool, True where a query may look.
        """
        N, B, _ = x.shape
        L = context.shape[1]
        queries = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=anchors)
        block_keys, block_values = self._keys_values(x)
        ctx_keys, ctx_values = self._keys_values(context)
        shape = (N, self.n_kv_heads, L, self.head_dim)
        keys = mx.concatenate([mx.broadcast_to(self.rope(ctx_keys, offset=0), shape),
                               self.rope(block_keys, offset=anchors)], axis=2)
        values = mx.concatenate([mx.broadcast_to(ctx_values, shape), block_values], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, B, -1))


class DrafterLayer(nn.Module):
    """Pre-norm transformer layer: KV-injected attention, then SwiGLU MLP."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.self_attn = DrafterAttention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, h: mx.array, context: mx.array, cache: Optional[KVCache] = None,
                 anchors: Optional[mx.array] = None, mask: Optional[mx.array] = None) -> mx.array:
        """Inference with ``cache``; training with ``anchors`` and ``mask`` instead."""
        x = self.input_layernorm(h)
        if cache is not None:
            h = h + self.self_attn(x, context, cache)
        else:
            h = h + self.self_attn.blocks(x, context, anchors, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The drafter network. Embedding and lm_head are borrowed from the target.

    Parameters (checkpoint keys): ``fc`` [H, K*H], ``hidden_norm`` [H],
    ``layers.{i}.*``, ``norm`` [H]. Call :meth:`bind` before use.
    """

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        n_ctx = len(args.target_layer_ids) * args.hidden_size
        self.fc = nn.Linear(n_ctx, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DrafterLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self._embed: Optional[Callable[[mx.array], mx.array]] = None
        self._lm_head: Optional[Callable[[mx.array], mx.array]] = None

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def target_layer_ids(self) -> List[int]:
        return self.args.target_layer_ids

    def bind(self, embed: Callable[[mx.array], mx.array], lm_head: Callable[[mx.array], mx.array]) -> "DFlashDrafter":
        """Borrow the target's (frozen) embedding and output head.

        Stored as plain callables, so they never appear in ``parameters()``, are
        never saved and are never trained.
        """
        self._embed, self._lm_head = embed, lm_head
        return self

    def make_cache(self) -> List[KVCache]:
        """One context-only KV cache per drafter layer."""
        return [KVCache() for _ in self.layers]

    def __call__(self, block: mx.array, context: mx.array, cache: Sequence[KVCache]) -> mx.array:
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
        if self._embed is None:
            raise RuntimeError("DFlashDrafter.bind(...) must be called before use")
        h = self._embed(block)
        fused = self.hidden_norm(self.fc(context))
        for layer, c in zip(self.layers, cache):
            h = layer(h, fused, c)
        return self._lm_head(self.norm(h[:, 1:]))

    def block_logits(self, blocks: mx.array, context: mx.array, anchors: mx.array, mask: mx.array) -> mx.array:
        """Training forward over many blocks of one sequence.

        Args:
            blocks: [N, B] int32, each ``[token at anchor, MASK x (B-1)]``.
            context: [1, L, K*H] target features of the whole sequence.
            anchors: [N] int32 anchor positions.
            mask: [N, 1, B, L + B] bool from :func:`dflash_mlx.train.blocks.block_mask`.

        Returns:
            [N, B-1, V] logits for block rows 1..B-1.
        """
        h = self._embed(blocks)
        fused = self.hidden_norm(self.fc(context))
        for layer in self.layers:
            h = layer(h, fused, anchors=anchors, mask=mask)
        return self._lm_head(self.norm(h[:, 1:]))

    def ingest(self, context: mx.array, cache: Sequence[KVCache]) -> None:
        """Cache context rows without drafting, so the drafter covers what the target
        cache covers (used when a generation ends; the next turn continues from it).

        Args:
            context: [1, S, K*H] context features at positions ``[offset, offset+S)``.
        """
        if context.shape[1] == 0:
            return
        fused = self.hidden_norm(self.fc(context))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.ingest(fused, c)

    def draft(self, token: mx.array, context: mx.array, cache: Sequence[KVCache], block_size: int) -> mx.array:
        """Greedy drafts for one block.

        Args:
            token: scalar or [1] int, the last committed token ``t_last``.
            context: [1, S, K*H] new context features.
            cache: drafter cache.
            block_size: B, 2 <= B <= trained block size.

        Returns:
            [B-1] int32 draft tokens d_1..d_{B-1} (lazy).
        """
        masks = mx.full((block_size - 1,), self.args.mask_token_id, dtype=mx.int32)
        block = mx.concatenate([token.reshape(1).astype(mx.int32), masks])[None]
        return mx.argmax(self(block, context, cache)[0], axis=-1)


def load_drafter(path_or_repo: str, dtype: Optional[mx.Dtype] = None) -> DFlashDrafter:
    """Load a drafter from a local folder or a Hugging Face repo id.

    Args:
        path_or_repo: folder with ``config.json`` and ``*.safetensors``, or a repo id
            (downloaded into the Hugging Face cache).
        dtype: cast floating-point weights to this dtype (default: as stored).

    Returns:
        An unbound :class:`DFlashDrafter`; call ``bind`` (or use
        :func:`dflash_mlx.load`), which also checks it against the target.

    Raises:
        CheckpointError: missing folder or files, corrupt safetensors, or weights
            that do not match the config (missing, unexpected or misshapen keys).
        ConfigError: invalid or non-DFlash config.
    """
    path = resolve_model_path(path_or_repo, DRAFTER_FILES, what="drafter")
    config_file = path / "config.json"
    config = read_config(config_file)
    args = DrafterArgs.from_config(config, source=str(config_file))
    weights = read_safetensors(path)
    model = DFlashDrafter(args)
    if (q := config.get("quantization")) is not None:
        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        detail = " ".join(str(e).split())
        raise CheckpointError(f"{path}: weights do not match config.json: {detail}") from None
    if dtype is not None:
        model.set_dtype(dtype)
    model.eval()
    mx.eval(model.parameters())
    return model


def save_drafter(model: DFlashDrafter, out_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` in the released format.

    Keys are unprefixed (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...);
    no embedding or lm_head is written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    dtype = str(next(iter(weights.values())).dtype).replace("mlx.core.", "")
    config = model.args.to_config(dtype=dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_config(config_file: Path) -> dict:
    """Read a ``config.json``; errors name the file."""
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: not found")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file}: invalid JSON ({e})") from None


def read_safetensors(path: Path) -> dict:
    """Load every ``*.safetensors`` file of a folder into one dict.

    Raises:
        CheckpointError: no weight file, or a file that is truncated or corrupt.
    """
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises RuntimeError/ValueError variants
            raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from None
    return weights
