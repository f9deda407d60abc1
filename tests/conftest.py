"""Tiny random targets and drafters built from ModelArgs, plus scripted drafters."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import signal
import sys
from pathlib import Path
from typing import List

import dataclasses

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map, tree_map_with_path
import pytest
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.models import (gemma3, gemma3_text, gemma4, gemma4_text, gpt_oss, llama, phi3, qwen3, qwen3_5,
                           qwen3_5_moe, qwen3_moe, qwen3_next, qwen3_vl, qwen3_vl_moe)

from forked_cli import dflash, spawn_dflash  # noqa: F401  (the tests' `dflash` commands)
from dflash_mlx import DFlashDrafter, DrafterArgs, bind_drafter, make_adapter, save_drafter

# A run started in the background by a non-interactive shell (`bash .ci/run &`) ignores
# SIGINT, and processes the tests start would inherit that: the Ctrl-C tests need their
# children to get it. A handler (unlike an ignored signal) is reset to the default on exec.
signal.signal(signal.SIGINT, signal.default_int_handler)

# Debian's OpenBLAS makes MLX's float32 CPU matmul far faster (README, "Run the tests"). Set here,
# before pytest-xdist starts its workers, so they and the `dflash` processes tests start
# load it; one BLAS thread each, as the workers already fill the cores.
_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
if sys.platform == "linux" and "LD_PRELOAD" not in os.environ and os.path.isfile(_OPENBLAS):
    os.environ["LD_PRELOAD"] = _OPENBLAS
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# pytest-xdist's workers run with COLUMNS=80 and LINES=24 set, and the commands fold their lines to COLUMNS in
# a pipe: without this every test would see an 80-column pipe; a test that wants a width sets it.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)
ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
STORIES = SHARED / "models" / "stories260K"
needs_shared = pytest.mark.skipif(
    not (STORIES / "stories260K.bin").is_file(),
    reason=f"needs ../shared/models/stories260K (not found at {STORIES}); CI always has it",
)

# name -> (mlx-lm module, ModelArgs extras). Every test parametrized by `family` runs
# for each. "llama-sliding" alternates sliding-window (window 8, far shorter than
# the 200-token tests) and full layers; so do gpt_oss and the Gemmas.
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, head_dim=16)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True)
FAMILIES = {
    "llama": (llama, dict(tie_word_embeddings=False)),
    "llama-sliding": (llama, dict(tie_word_embeddings=False, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"] * 2)),
    # Llama 3.1 and 3.3 share this rope_scaling block (Llama3RoPE; their rope_theta
    # is 500000, which makes this tiny model's output too repetitive to test).
    "llama3.1": (llama, dict(tie_word_embeddings=False, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))),
    "phi3": (phi3, dict(tie_word_embeddings=False)),  # fused qkv_proj and gate_up_proj
    "qwen3": (qwen3, dict(head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": (qwen3_moe, dict(head_dim=16, tie_word_embeddings=False, **_MOE)),
    # Hybrids: Gated-DeltaNet layers 0 and 2, attention 1 and 3 (qwen3_next: 0-2 and 3).
    "qwen3_5": (qwen3_5, dict(full_attention_interval=2, tie_word_embeddings=False, **_GDN)),
    "qwen3_5_moe": (qwen3_5_moe, dict(full_attention_interval=2, tie_word_embeddings=True,
                                      shared_expert_intermediate_size=32, **_GDN, **_MOE)),
    "qwen3_next": (qwen3_next, dict(full_attention_interval=4, tie_word_embeddings=False,
                                    partial_rotary_factor=0.25, shared_expert_intermediate_size=32,
                                    **_GDN, **_MOE)),
    "gpt_oss": (gpt_oss, dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    "gemma3_text": (gemma3_text, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                      sliding_window_pattern=2)),
    # Per-layer inputs, KV sharing (layers 2-3 reuse 0-1), MoE, k_eq_v, softcapping.
    # Untied: a tied tiny random Gemma echoes its input token.
    "gemma4_text": (gemma4_text, dict(tie_word_embeddings=False, head_dim=16, global_head_dim=32, sliding_window=8,
                                      sliding_window_pattern=2, num_kv_shared_layers=2,
                                      hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
                                      enable_moe_block=True, num_experts=4, top_k_experts=2,
                                      moe_intermediate_size=32, attention_k_eq_v=True,
                                      num_global_key_value_heads=1, final_logit_softcapping=30.0)),
    "qwen3_vl": (qwen3_vl, dict(head_dim=16, tie_word_embeddings=True)),  # text model inside
}
# Vision-language wrappers around a text family above (tests/test_targets.py).
WRAPPERS = {
    "gemma3": (gemma3, FAMILIES["gemma3_text"][1]),
    "gemma4": (gemma4, FAMILIES["gemma4_text"][1]),
    "qwen3_vl_moe": (qwen3_vl_moe, FAMILIES["qwen3_moe"][1]),
}
# Random weights scaled by this give varied greedy output (at scale 1 a tiny qwen3
# target repeats one token, which makes lossless tests vacuous).
SCALE = 1.5


def tiny_target(family: str, vocab: int = 256, hidden: int = 64, layers: int = 4, seed: int = 0,
                scale: float = SCALE):
    """A tiny random mlx-lm model of ``family`` (or wrapper) and its adapter, float32."""
    module, extra = {**FAMILIES, **WRAPPERS}[family]
    params = dict(
        model_type=module.__name__.rsplit(".", 1)[-1], hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=10000.0, max_position_embeddings=4096,
    )
    params.update(extra)
    if "hidden_size" not in inspect.signature(module.ModelArgs).parameters:  # a wrapper
        params = dict(model_type=params["model_type"], vocab_size=vocab, text_config=params)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(params))
    if scale != 1.0:
        model.update(tree_map(lambda p: p * scale, model.parameters()))
    # Parameters initialised to zero (gpt-oss attention sinks) get random values, so
    # the tests exercise them.
    model.update(tree_map(lambda p: mx.random.normal(p.shape) if not mx.any(p).item() else p,
                          model.parameters()))
    mx.eval(model.parameters())
    return model, make_adapter(model)


def tiny_drafter_args(target, layers: int = 1, block_size: int = 16, layer_ids=None) -> DrafterArgs:
    return DrafterArgs(
        hidden_size=target.hidden_size, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=2 * target.hidden_size,
        vocab_size=target.vocab_size, target_layer_ids=layer_ids or [1, target.num_layers - 1],
        mask_token_id=target.vocab_size - 1, block_size=block_size,
        num_target_layers=target.num_layers, rms_norm_eps=1e-6, rope_theta=10000.0,
    )


def tiny_drafter(target, seed: int = 1, **kwargs) -> DFlashDrafter:
    """A random DFlash drafter bound to ``target``."""
    mx.random.seed(seed)
    drafter = DFlashDrafter(tiny_drafter_args(target, **kwargs))
    mx.eval(drafter.parameters())
    return bind_drafter(drafter, target)


def randomize(drafter, seed: int = 2):
    """Random weights everywhere, norms and DFlash2 pieces included (default norms are
    ones, a fresh block convolution is the identity, fresh codebooks are zeros)."""
    rng = np.random.default_rng(seed)

    def new(path, p):
        if path.endswith("norm.weight"):
            v = 1.0 + 0.2 * rng.standard_normal(p.shape)
        elif path.endswith("base_kernel"):
            v = 0.5 * rng.standard_normal(p.shape)
        else:
            v = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
        return mx.array(v.astype(np.float32))

    drafter.update(tree_map_with_path(new, drafter.parameters()))
    mx.eval(drafter.parameters())
    return drafter


# Tiny drafters of every released format (spec sections 2, 9 and 11), verifies of 8 tokens.
# v1-sliding: a causal sliding layer (window 5, shorter than the block) and a full
# layer. dflash2: all layers sliding and bidirectional (is_causal false), as the
# released DFlash2 checkpoints are, 3-tap convolution, selector over 4 candidates,
# every scale set. muse: v1 under Muse-Glimmer's names. dspark: anchor-first (a
# trained block of 7), a rank-16 Markov head and a confidence head reading it;
# dflash-block7: the same without either head (DeepSeek's DFlash block7).
FORMATS = {
    "v1": dict(),
    "v1-sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
    "dflash2": dict(architecture="DFlash2DraftModel", layer_types=["sliding_attention"] * 2, sliding_window=5,
                    is_causal=False, conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4,
                    input_embedding_scale=1.5, output_multiplier=0.5, final_logit_softcapping=3.0),
    "muse": dict(architecture="MuseGlimmerAssistantModel"),
    "dspark": dict(architecture="Qwen3DSparkModel", markov_rank=16, enable_confidence_head=True,
                   confidence_head_with_markov=True),
    "dflash-block7": dict(architecture="Qwen3DSparkModel"),
    "gemma4-dspark": dict(architecture="Gemma4DSparkModel", markov_rank=16, enable_confidence_head=True,
                          confidence_head_with_markov=True, global_head_dim=32, num_global_key_value_heads=1,
                          attention_k_eq_v=True, final_logit_softcapping=30.0, rope_theta=1_000_000.0,
                          rope_scaling=dict(rope_type="proportional", partial_rotary_factor=0.25)),
}


def format_drafter(target, fmt: str, seed: int = 1, block_size: int = 8, bind: bool = True, **over) -> DFlashDrafter:
    """A random 2-layer drafter of format ``fmt`` (a key of FORMATS) for verifies of ``block_size``, bound to
    ``target`` (``bind``); a format storing embeddings holds copies of the target's (as released)."""
    args = dataclasses.replace(tiny_drafter_args(target, layers=2, block_size=block_size), **{**FORMATS[fmt], **over})
    if args.format.anchor_first:  # row 0 drafts too: a trained block one shorter than the verify
        args = dataclasses.replace(args, block_size=args.block_size - 1)
    args.validate()
    mx.random.seed(seed)
    drafter = randomize(DFlashDrafter(args), seed)
    if args.format.stores_embeddings:
        embed = target.inner.embed_tokens
        drafter.embed_tokens.weight = embed.weight
        drafter.lm_head.weight = (target.text.lm_head if hasattr(target.text, "lm_head") else embed).weight
    return bind_drafter(drafter, target) if bind else drafter


def mlx_lm_greedy(model, prompt: List[int], n: int) -> List[int]:
    """n greedy tokens from mlx-lm's own generate_step (the reference)."""
    out = []
    for tok, _ in mlx_generate_step(mx.array(prompt, dtype=mx.int32), model, max_tokens=n):
        out.append(int(tok))
    return out


def tiny_training_set(count: int, response: int):
    """The training tests' tiny qwen3 target and ``count`` sequences of it: a random
    4-token prompt and the target's own greedy ``response`` tokens (response_start 4).

    Returns:
        ``(model, target, [TrainSequence])``.
    """
    from dflash_mlx.train.data import TrainSequence

    model, target = tiny_target("qwen3", vocab=64, hidden=32, layers=3, seed=5, scale=1.5)
    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(count):
        prompt = rng.integers(3, 64, size=4).tolist()
        seqs.append(TrainSequence(np.array(prompt + mlx_lm_greedy(model, prompt, response), dtype=np.int32), 4))
    return model, target, seqs


def assert_varied(tokens: List[int], at_least: int = 20) -> None:
    """A lossless test is only as strong as its reference is varied."""
    assert len(set(tokens)) >= at_least, f"reference output too repetitive: {len(set(tokens))} distinct tokens"


class ByteTokenizer:
    """What stream_generate needs of a tokenizer: tokens are UTF-8 bytes, no stop token."""

    eos_token_ids = ()

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    @property
    def detokenizer(self):
        from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

        return NaiveStreamingDetokenizer(self)


class _Position:
    """Stand-in drafter cache: counts context rows, like KVCache.offset."""

    def __init__(self):
        self.offset = 0


class ScriptedDrafter:
    """A :class:`dflash_mlx.protocol.Drafter` that proposes a known continuation: right for the first ``correct`` slots, then wrong.

    ``sequence`` is prompt + the target's greedy continuation. Slot k of a block
    (1-based) proposes ``sequence[pos + k]`` if ``k <= correct`` and a different
    token otherwise, where ``pos`` is the absolute position of ``t_last`` derived
    from the context rows seen (offset + S, the spec's invariant).
    """

    def __init__(self, sequence: List[int], correct: int, block_size: int, vocab: int,
                 layer_ids=(1,), check_anchor: bool = True):
        self.sequence, self.correct, self.vocab = sequence, correct, vocab
        self.block_size, self.target_layer_ids = block_size, list(layer_ids)
        self.check_anchor = check_anchor
        self.calls = 0

    def make_cache(self):
        return [_Position()]

    def ingest(self, context: mx.array, cache) -> None:
        cache[0].offset += context.shape[1]

    def draft(self, token: mx.array, context: mx.array, cache, block_size: int) -> mx.array:
        pos = cache[0].offset + context.shape[1]
        cache[0].offset = pos
        self.calls += 1
        if self.check_anchor:
            assert int(token.item()) == self.sequence[pos], "t_last is not at offset + S"
        out = []
        for k in range(1, block_size):
            right = self.sequence[pos + k] if pos + k < len(self.sequence) else 0
            out.append(right if k <= self.correct else (right + 1) % self.vocab)
        return mx.array(out, dtype=mx.int32)


@pytest.fixture(autouse=True)
def scratch_cache(monkeypatch, tmp_path_factory):
    """What dflash-mlx keeps on disk goes to a scratch cache folder (also for the CLI
    processes tests start), never the user's."""
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path_factory.mktemp("dflash-cache")))


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def stories(tmp_path_factory) -> Path:
    """stories260K from ../shared converted to an mlx-lm folder (tests using it skip without it)."""
    if not (STORIES / "stories260K.bin").is_file():
        pytest.skip(f"needs ../shared/models/stories260K (not found at {STORIES}); CI always has it")
    spec = importlib.util.spec_from_file_location("llama2c", ROOT / "scripts" / "convert" / "llama2c.py")
    llama2c = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llama2c)
    return llama2c.convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.model",
                                   tmp_path_factory.mktemp("stories260K"))


@pytest.fixture(scope="session")
def random_drafter(tmp_path_factory) -> Path:
    """An untrained 1-layer drafter for stories260K (block size 8), saved in the released format."""
    mx.random.seed(0)
    drafter = DFlashDrafter(DrafterArgs(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
        intermediate_size=128, vocab_size=512, target_layer_ids=[1, 4], mask_token_id=0,
        block_size=8, num_target_layers=5, rms_norm_eps=1e-5, rope_theta=10000.0,
    ))
    mx.eval(drafter.parameters())
    return save_drafter(drafter, tmp_path_factory.mktemp("drafter"))


# -- servers: `dflash serve` processes, in-process apps, clients --------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log: Path, *args: str, launch: List[str] = ()):
    """`dflash serve ARGS` on a free loopback port, its output in ``log``; returns
    (the process, its base URL) once /health answers. Killed if it does not start.
    ``launch``: a launcher the command runs under (``mlx.launch ... --``), in a process group of its own."""
    import subprocess
    import time

    import httpx

    port = free_port()
    env = {**os.environ, "DFLASH_API_KEY": ""}
    if launch:
        cmd = [*launch, sys.executable, "-m", "dflash_mlx.cli.main", "serve", "--port", str(port), *args]
        with open(log, "w") as out:
            # stdin: a pipe left open (at the end of its input mlx.launch polls it without pause)
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
    else:
        proc = spawn_dflash("serve", "--port", str(port), *args, log=log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the server exited: {log.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server did not start: {log.read_text()}"
            time.sleep(0.2)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL) if launch else proc.kill()
        proc.wait()
        raise


@contextlib.contextmanager
def live_server(log: Path, *args: str):
    """`dflash serve ARGS` on a free loopback port; yields its base URL, stops it after."""
    import subprocess

    proc, url = start_server(log, *args)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def live_app(app, **kw):
    """``app`` under uvicorn on a free loopback port, in a thread; yields the port."""
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", **kw))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(3000):  # waiting for the start, not deciding anything
            if server.started:
                break
            time.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield server.config.port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def openai_client(url: str, key: str = "none", timeout: float = 120):
    """An OpenAI client of the server at ``url`` (no retries)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=timeout)


def parse_metrics(text: str) -> dict:
    """``{"name{labels}": value}`` of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class TemplateTokenizer(ByteTokenizer):
    """Byte tokens and a toy chat template; records where and how it was called."""

    has_chat_template = True

    def __init__(self):
        self.threads, self.template_kwargs = [], []

    def encode(self, text, add_special_tokens=True):
        import threading

        self.threads.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        self.template_kwargs.append(kwargs)
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


SERVED = "tiny"  # the model name of :func:`tiny_server_pair`'s apps


def tiny_server_pair(context: int = 64, on_forward=None):
    """A pair for in-process servers: tiny llama target (``context`` tokens), drafter, TemplateTokenizer.

    ``on_forward(inputs)``, when given, runs before each of the target's forwards (prefill chunks,
    verify and plain steps; ``inputs``: [N, L] ids) on the thread that runs it: a test observes or
    holds the engine there, through the target it was given."""
    from types import SimpleNamespace

    model, target = tiny_target("llama")
    if on_forward is not None:
        class Observed(type(target)):
            def __call__(self, inputs, *args, **kwargs):
                on_forward(inputs)
                return super().__call__(inputs, *args, **kwargs)

        target = Observed(model)
    model.args.max_position_embeddings = context  # what the server reads as the context
    return SimpleNamespace(model=model, target=target, tokenizer=TemplateTokenizer(), drafter=tiny_drafter(target),
                           draft_path="tiny-drafter")


def app_client(pair, model_id: str = SERVED, max_tokens: int = 4, **config):
    """A starlette TestClient of ``create_app(pair, ServerConfig(...))``."""
    from starlette.testclient import TestClient

    from dflash_mlx.serve.app import ServerConfig, create_app

    app = create_app(pair, ServerConfig(model_id=model_id, max_tokens=max_tokens, **config))
    return TestClient(app, raise_server_exceptions=False)


def pair_cache(*args, **kwargs):
    """A :class:`PairCache` whose ``stream`` runs :func:`stream_generate` (its callers in the package pass it)."""
    from dflash_mlx.decode.generate import stream_generate
    from dflash_mlx.prompt_cache.pair import PairCache

    kwargs.setdefault("generate", stream_generate)
    return PairCache(*args, **kwargs)
