#!/usr/bin/env python3
"""Train the SmolLM2 drafter on a CUDA machine with PyTorch, where this project's MLX trainer cannot go.

On a CPU the drafter stays short of data and steps (docs/train.md says how far); a CUDA GPU makes far more
of both in minutes. The recipe is `dflash train`'s (spec section 6):
frozen target, its embedding and head shared; a block ``[token[a], MASK x (B-1)]`` per anchor ``a`` in the
response, all blocks of a sequence in one masked forward (a block sees the context features before its
anchor and its own rows); row k's cross-entropy weighted by ``exp(-(k-1)/gamma)``; block sizes 4, 8 and 16
drawn per step. Differences: the softmax runs over the whole vocabulary, anchors are uniform, and the learning
rate follows the time left (warmup, then cosine) since the run is bounded by wall-clock time.

Two steps:

    # here (MLX venv): token ids of everything the run needs, beside the target's GGUF
    python scripts/smollm2/cuda_train.py prepare --model OUT/smol --data OUT/data-train [--data ...] \\
        --prompts OUT/prompts/variants4.jsonl [...] --heldout OUT/data-heldout --out DIR/inputs.npz
    # there (python3 with torch, transformers and gguf): regenerate, train, write the drafter
    python3 scripts/smollm2/cuda_train.py run --gguf SmolLM2-135M-Instruct.Q4_1.gguf --inputs DIR/inputs.npz \\
        --init examples/smollm2-135m/drafter --seconds 520 --out OUT

``run`` writes ``drafter-{0,1,...}.safetensors`` (this project's keys, float32: the fc and norms, then one
file per layer, each under 16 MiB), ``config.json``, ``log.txt`` and, in the files left of the 8 a lent machine
returns, ``sequences-{0,1,...}.npz`` (the sequences it made: ``tokens`` uint16, ``lengths``,
``response_starts``); ``merge`` joins the parts into a drafter folder `dflash` loads:

    python scripts/smollm2/cuda_train.py merge --parts OUT --out DRAFTER \
        [--draft-vocab 8192 --data OUT/data-train ...]   # FR-Spec's reduced draft vocabulary, counted there
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
GAMMA = {4: 4.0, 8: 4.0, 16: 7.0}  # dflash_mlx.train.blocks.default_gamma of the block sizes trained
RETURNED_FILES, SEQUENCE_BYTES = 8, 18_000_000  # what a lent machine gives back: 8 files (64 MiB in all)


# ----------------------------------------------------------------------------------------------- prepare (MLX)
def pack(seqs) -> tuple:
    """``(tokens uint16, lengths int32, starts int32)`` of ``(tokens, response_start)`` pairs."""
    tokens = np.concatenate([np.asarray(t, dtype=np.uint16) for t, _ in seqs]) if seqs else np.zeros(0, np.uint16)
    return tokens, np.array([len(t) for t, _ in seqs], np.int32), np.array([s for _, s in seqs], np.int32)


def prepare(a) -> int:
    sys.path.insert(0, str(ROOT))
    from mlx_lm.utils import load_tokenizer

    from dflash_mlx.train.data import encode_prompts, load_sequences, read_prompt_file

    tokenizer = load_tokenizer(Path(a.model))
    config = json.loads((Path(a.model) / "config.json").read_text())
    drafter = json.loads((Path(a.init) / "config.json").read_text())
    train = [(s.tokens, s.response_start) for d in a.data for s in load_sequences(d)]
    prompts = [p for f in a.prompts for p in encode_prompts(tokenizer, read_prompt_file(f))]
    out = {}
    for name, seqs in [("train", train)] + [(f"heldout_{Path(d).name}", [(s.tokens, s.response_start)
                                                                         for s in load_sequences(d)])
                                            for d in a.heldout]:
        out[f"{name}_tokens"], out[f"{name}_lengths"], out[f"{name}_starts"] = pack(seqs)
    out["prompt_tokens"], out["prompt_lengths"], out["prompt_starts"] = pack([(p, 0) for p in prompts])
    marker = "dflash-user-turn"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    head, tail = text.split(marker)
    out["user_start"] = np.array(tokenizer.encode(head, add_special_tokens=False), np.int32)
    out["user_end"] = np.array(tokenizer.encode(tail, add_special_tokens=False), np.int32)
    meta = {"target": config, "drafter": drafter, "eos": int(tokenizer.eos_token_id),
            "heldout": [Path(d).name for d in a.heldout]}
    out["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez_compressed(a.out, **out)
    print(f"{a.out}: {len(train)} training sequences, {len(prompts)} prompts, user turn "
          f"{out['user_start'].tolist()} ... {out['user_end'].tolist()}")
    return 0


# ------------------------------------------------------------------------------------------------- run (torch)
def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary interleaving of a Q or K projection [heads * hd, H] undone (Hugging Face's half split)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_target(path: str, cfg: dict, device):
    """Hugging Face ``LlamaForCausalLM`` [float32, eval, frozen] from a Llama GGUF file (dequantized by ``gguf``)."""
    import gguf
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    state = {}
    for t in gguf.GGUFReader(path).tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape)))
        parts = t.name.split(".")
        if parts[0] == "token_embd":
            state["model.embed_tokens.weight"] = w
        elif parts[0] == "output_norm":
            state["model.norm.weight"] = w
        elif parts[0] == "output":
            state["lm_head.weight"] = w
        elif parts[0] == "blk":
            if parts[2] == "attn_q":
                w = unpermute(w, cfg["num_attention_heads"])
            elif parts[2] == "attn_k":
                w = unpermute(w, cfg["num_key_value_heads"])
            state[f"model.layers.{parts[1]}.{names[parts[2]]}.weight"] = w
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
            "bos_token_id", "eos_token_id")
    config = LlamaConfig(**{k: cfg[k] for k in keys}, rope_theta=cfg["rope_theta"])
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    if unexpected or [k for k in missing if not (k == "lm_head.weight" and cfg["tie_word_embeddings"])]:
        raise SystemExit(f"{path}: weights do not fit a Llama: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(device).eval()


def rms_norm(x, w, eps):
    import torch

    dtype = x.dtype
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * w.to(dtype)


def rope(x, pos, theta):
    """Hugging Face / MLX ``traditional=False`` rotary embedding of x [..., T, hd] at positions pos [..., T]."""
    import torch

    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = pos.float()[..., None] * inv  # [..., T, hd/2]
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def make_drafter(cfg: dict):
    """The DFlash drafter (v1, full attention) as plain torch modules, keyed as this project saves it."""
    import torch
    import torch.nn as nn

    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv, K = cfg["num_attention_heads"], cfg["num_key_value_heads"], len(cfg["dflash_config"]["target_layer_ids"])

    def norm(n):
        m = nn.Module()
        m.weight = nn.Parameter(torch.ones(n))
        return m

    def layer():
        m = nn.Module()
        m.input_layernorm, m.post_attention_layernorm = norm(H), norm(H)
        m.self_attn = nn.Module()
        a = m.self_attn
        a.q_proj, a.k_proj = nn.Linear(H, nh * hd, bias=False), nn.Linear(H, nkv * hd, bias=False)
        a.v_proj, a.o_proj = nn.Linear(H, nkv * hd, bias=False), nn.Linear(nh * hd, H, bias=False)
        a.q_norm, a.k_norm = norm(hd), norm(hd)
        m.mlp = nn.Module()
        m.mlp.gate_proj, m.mlp.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        m.mlp.down_proj = nn.Linear(I, H, bias=False)
        return m

    d = nn.Module()
    d.fc, d.hidden_norm, d.norm = nn.Linear(K * H, H, bias=False), norm(H), norm(H)
    d.layers = nn.ModuleList([layer() for _ in range(cfg["num_hidden_layers"])])
    return d


def load_drafter_weights(drafter, folder: Path) -> None:
    """This project's drafter file (float, or 8-bit MLX affine ``weight``/``scales``/``biases``) into ``drafter``;
    a draft vocabulary's ``d2t`` is left out (the drafter trains over the whole vocabulary)."""
    import torch
    from safetensors.torch import load_file

    raw = load_file(str(folder / "model.safetensors"))
    q = json.loads((folder / "config.json").read_text()).get("quantization") or {}
    state = {}
    for k, v in raw.items():
        if k.endswith((".scales", ".biases")) or k == "d2t":  # merge --draft-vocab makes the draft vocabulary again
            continue
        base = k[: -len(".weight")]
        if f"{base}.scales" in raw:
            bits, group = q["bits"], q["group_size"]
            if bits != 8:
                raise SystemExit(f"{folder}: only 8-bit files are read here, not {bits}-bit")
            codes = v.contiguous().view(torch.uint8).reshape(v.shape[0], -1).float()
            scales, biases = raw[f"{base}.scales"].float(), raw[f"{base}.biases"].float()
            w = codes.reshape(v.shape[0], -1, group) * scales[..., None] + biases[..., None]
            v = w.reshape(v.shape[0], -1)
        state[k] = v.float()
    drafter.load_state_dict(state, strict=True)


def grow(drafter, cfg: dict, layers: int) -> None:
    """Add layers to ``drafter`` (and ``cfg``) up to ``layers``: random, their output projections zero, so the
    drafter starts as it was (``dflash train --layers``'s rule)."""
    import torch

    while len(drafter.layers) < layers:
        new = make_drafter({**cfg, "num_hidden_layers": 1}).layers[0]
        with torch.no_grad():
            new.self_attn.o_proj.weight.zero_()
            new.mlp.down_proj.weight.zero_()
        drafter.layers.append(new)
    cfg["num_hidden_layers"] = len(drafter.layers)
    cfg["layer_types"] = ["full_attention"] * len(drafter.layers)


def drafter_hidden(d, cfg, embed, feats, blocks, anchors, valid):
    """Training forward: feats [S, L, K*H], blocks [S, N, B] int, anchors [S, N] (valid [S, N] bool) -> final
    normed hidden states [S, N, B-1, H] of rows 1..B-1 (spec section 6)."""
    import torch
    import torch.nn.functional as F

    S, L, _ = feats.shape
    N, B = blocks.shape[1], blocks.shape[2]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    c = rms_norm(d.fc(feats), d.hidden_norm.weight, eps)  # [S, L, H]
    h = embed[blocks].reshape(S, N * B, -1).to(c.dtype)
    pos_b = (anchors[:, :, None] + torch.arange(B, device=h.device)).reshape(S, N * B)
    pos_c = torch.arange(L, device=h.device)[None].expand(S, L)
    # block query (n, i) sees context column p < anchor[n] and its own block's B columns
    col = torch.arange(L, device=h.device)
    ctx = (col[None, None, :] < anchors[:, :, None]) & valid[:, :, None]  # [S, N, L]
    ctx = ctx[:, :, None, :].expand(S, N, B, L).reshape(S, N * B, L)
    own = torch.eye(N, dtype=torch.bool, device=h.device)[:, None, :, None].expand(N, B, N, B).reshape(N * B, N * B)
    mask = torch.cat([ctx, own[None].expand(S, -1, -1)], dim=-1)[:, None]  # [S, 1, N*B, L + N*B]
    for layer in d.layers:
        a = layer.self_attn
        x = rms_norm(h, layer.input_layernorm.weight, eps)

        def heads(y, n):
            return y.reshape(S, y.shape[1], n, hd).transpose(1, 2)

        q = rope(rms_norm(heads(a.q_proj(x), nh), a.q_norm.weight, eps), pos_b[:, None], theta)
        kb = rope(rms_norm(heads(a.k_proj(x), nkv), a.k_norm.weight, eps), pos_b[:, None], theta)
        kc = rope(rms_norm(heads(a.k_proj(c), nkv), a.k_norm.weight, eps), pos_c[:, None], theta)
        k = torch.cat([kc, kb], dim=2)
        v = torch.cat([heads(a.v_proj(c), nkv), heads(a.v_proj(x), nkv)], dim=2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        h = h + a.o_proj(o.transpose(1, 2).reshape(S, N * B, nh * hd))
        x = rms_norm(h, layer.post_attention_layernorm.weight, eps)
        h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))
    h = rms_norm(h, d.norm.weight, eps).reshape(S, N, B, -1)
    return h[:, :, 1:]


def target_features(target, tokens, attention, layer_ids):
    """[S, L, K*H] residual streams after each of ``layer_ids`` (Hugging Face ``hidden_states[l + 1]``)."""
    import torch

    with torch.no_grad():
        out = target.model(input_ids=tokens, attention_mask=attention, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def make_batch(seqs, rng, B, anchors_per_seq, device):
    """Padded tokens [S, L], attention [S, L], blocks [S, N, B], anchors, valid [S, N], labels [S, N, B-1]."""
    import torch

    L = max(len(t) for t, _ in seqs)
    N = anchors_per_seq
    tokens = np.zeros((len(seqs), L), np.int64)
    attention = np.zeros((len(seqs), L), np.int64)
    anchors = np.zeros((len(seqs), N), np.int64)
    valid = np.zeros((len(seqs), N), bool)
    for i, (t, start) in enumerate(seqs):
        tokens[i, : len(t)], attention[i, : len(t)] = t, 1
        cand = np.arange(max(start, 1), len(t) - B + 1)
        if cand.size:
            pick = np.sort(rng.choice(cand, size=min(N, cand.size), replace=False))
            anchors[i, : pick.size], valid[i, : pick.size] = pick, True
    rows = anchors[:, :, None] + np.arange(B)
    labels = tokens[np.arange(len(seqs))[:, None, None], rows[:, :, 1:]]
    return [torch.from_numpy(x).to(device) for x in (tokens, attention, anchors, valid, labels)]


def block_loss(d, cfg, target, embed, batch, mask_id, B, layer_ids):
    """Weighted cross-entropy (spec section 6) over valid blocks through the target's head, and the greedy
    acceptance lengths [M] int of the M valid blocks."""
    import torch
    import torch.nn.functional as F

    tokens, attention, anchors, valid, labels = batch
    feats = target_features(target, tokens, attention, layer_ids)
    blocks = torch.full((*anchors.shape, B), mask_id, dtype=torch.long, device=tokens.device)
    blocks[:, :, 0] = torch.gather(tokens, 1, anchors)
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=tokens.device.type == "cuda"):
        h = drafter_hidden(d, cfg, embed, feats, blocks, anchors, valid)
        logits = h[valid] @ target.lm_head.weight.T.to(h.dtype)  # [M, B-1, V]
    logits = logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[valid].reshape(-1), reduction="none")
    w = torch.exp(-torch.arange(B - 1, device=ce.device, dtype=torch.float32) / GAMMA[B])
    loss = (ce.reshape(-1, B - 1) * w).sum() / (w.sum() * max(int(valid.sum()), 1))
    right = (logits.argmax(-1) == labels[valid]).int()
    return loss, torch.cumprod(right, dim=-1).sum(-1) + 1


def unpack(z, name):
    tokens, lengths, starts = z[f"{name}_tokens"].astype(np.int64), z[f"{name}_lengths"], z[f"{name}_starts"]
    ends = np.cumsum(lengths)
    return [(tokens[e - n:e], int(s)) for e, n, s in zip(ends, lengths, starts)]


def generate(target, prompts, eos, device, log, deadline, batch, **kw):
    """``[(prompt + reply ids, len(prompt), finished)]`` of the prompts in their order until ``deadline`` (left-padded
    batches, shortest first within each window of 4 batches: similar lengths, and a run cut short still holds
    every part of a mixed list); a reply ends after its first ``eos``. A batch the GPU has no memory for is run
    again in halves (longer prompts come later), so what was made before is kept."""
    import torch

    window = 4 * batch
    order = [i for lo in range(0, len(prompts), window)
             for i in sorted(range(lo, min(lo + window, len(prompts))), key=lambda i: len(prompts[i]))]
    made, lo = [], 0
    while lo < len(order):
        if time.time() > deadline:
            log(f"generation stopped at its deadline: {lo} of {len(order)} prompts")
            break
        chunk = [prompts[i] for i in order[lo:lo + batch]]
        L = max(len(p) for p in chunk)
        ids = torch.zeros((len(chunk), L), dtype=torch.long)
        att = torch.zeros((len(chunk), L), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, L - len(p):], att[i, L - len(p):] = torch.as_tensor(p), 1
        try:
            with torch.no_grad():
                out = target.generate(input_ids=ids.to(device), attention_mask=att.to(device), eos_token_id=eos,
                                      pad_token_id=eos, **kw).cpu().numpy()[:, L:]
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                log(f"generation stopped: out of memory for one prompt of {L} tokens ({lo} of {len(order)} done)")
                break
            batch = max(1, batch // 2)
            torch.cuda.empty_cache()
            log(f"out of memory for {len(chunk)} prompts of up to {L} tokens: batches of {batch} from here")
            continue
        lo += len(chunk)
        for p, r in zip(chunk, out):
            stop = np.nonzero(r == eos)[0]
            r = r[: stop[0] + 1] if stop.size else r
            made.append((np.concatenate([np.asarray(p), r]).astype(np.int64), len(p), bool(stop.size)))
        log(f"generated {len(made)} of {len(order)}")
    return made


def tf_tau(d, cfg, target, embed, seqs, mask_id, layer_ids, device, B=16):
    """Teacher-forced acceptance length at ``B`` over every anchor of ``seqs`` (the mean of accepted + 1)."""
    import torch

    taus = []
    with torch.no_grad():
        for t, s in seqs:
            n = len(t) - B + 1 - max(s, 1)
            if n <= 0:
                continue
            batch = make_batch([(t, s)], np.random.default_rng(0), B, n, device)
            taus.append(block_loss(d, cfg, target, embed, batch, mask_id, B, layer_ids)[1].float())
    return float(torch.cat(taus).mean()) if taus else float("nan")


def run(a) -> int:
    import torch
    from safetensors.numpy import save_file

    t0 = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "log.txt", "a")

    def log(msg):
        line = f"[{time.time() - t0:6.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = torch.device(a.device)
    z = np.load(a.inputs)
    meta = json.loads(bytes(z["meta"]).decode())
    tcfg, dcfg, eos = meta["target"], meta["drafter"], meta["eos"]
    layer_ids, mask_id = dcfg["dflash_config"]["target_layer_ids"], dcfg["dflash_config"]["mask_token_id"]
    target = load_target(a.gguf, tcfg, device)
    embed = target.model.embed_tokens.weight.detach()
    log(f"target loaded on {device}")
    drafter = make_drafter(dcfg)
    load_drafter_weights(drafter, Path(a.init))
    grow(drafter, dcfg, a.layers)
    drafter = drafter.to(device)
    heldout = {name: unpack(z, f"heldout_{name}")[: a.eval_sequences] for name in meta["heldout"]}
    log("held-out teacher-forced tau at B=16, start: " + ", ".join(
        f"{k} {tf_tau(drafter, dcfg, target, embed, v, mask_id, layer_ids, device):.3f}" for k, v in heldout.items()))

    # data: the target's own replies to the given prompts and to user turns it samples itself
    pool = unpack(z, "train")
    made = []
    try:
        users = []
        start, end = z["user_start"].tolist(), z["user_end"].tolist()
        while len(users) < a.self_prompts and time.time() < t0 + a.self_prompt_seconds:
            n = min(a.gen_batch, a.self_prompts - len(users))
            got = generate(target, [start] * n, eos, device, log, t0 + a.self_prompt_seconds, n, do_sample=True,
                           temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=a.user_tokens)
            for ids, s, done in got:
                u = ids[s:-1].tolist()
                if done and len(u) >= 6:
                    users.append(start + u + end)
        log(f"{len(users)} self-sampled user turns")
        prompts = [p.tolist() for p, _ in unpack(z, "prompt")]
        mixed = [p for pair in zip(users, prompts) for p in pair] + users[len(prompts):] + prompts[len(users):]
        made = generate(target, mixed, eos, device, log, t0 + a.generate_seconds, a.gen_batch, do_sample=False,
                        max_new_tokens=a.max_tokens)
    except Exception as e:  # a failed generation still trains on what there is
        log(f"generation failed: {e!r}")
    pool += [(t, s) for t, s, _ in made if len(t) - s > 16]
    log(f"training on {len(pool)} sequences ({len(made)} made here)")

    # training, until the time is up
    params = [p for p in drafter.parameters()]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(a.seed)
    train_start, train_end = time.time(), t0 + a.seconds - a.save_seconds
    step, losses, taus = 0, [], []  # every 10th step's, since the last log line
    try:
        while time.time() < train_end:
            frac = (time.time() - train_start) / max(train_end - train_start, 1.0)
            lr = a.lr * min(1.0, frac / a.warmup) if frac < a.warmup else \
                a.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (frac - a.warmup) / (1 - a.warmup))))
            for g in opt.param_groups:
                g["lr"] = lr
            B = int(rng.choice([4, 8, 16]))
            seqs = [pool[i] for i in rng.integers(0, len(pool), a.seqs_per_step)]
            batch = make_batch(seqs, rng, B, a.anchors, device)
            loss, tau = block_loss(drafter, dcfg, target, embed, batch, mask_id, B, layer_ids)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % 10 == 0:  # a host sync: not every step
                losses.append(float(loss.detach()))
                taus += [float(tau.float().mean())] if B == 16 else []
            if step % a.log_every == 0:
                shown = f"{np.mean(taus):.3f}" if taus else "-"
                mean_loss = np.mean(losses) if losses else float("nan")
                log(f"step {step} lr {lr:.2e} loss {mean_loss:.4f} train tau@16 {shown}")
                losses, taus = [], []
            if step % a.eval_every == 0:
                log(f"step {step} held-out tau@16: " + ", ".join(
                    f"{k} {tf_tau(drafter, dcfg, target, embed, v, mask_id, layer_ids, device):.3f}"
                    for k, v in heldout.items()))
    except Exception as e:  # what was trained is still written
        log(f"training stopped at step {step}: {e!r}")
    log(f"trained {step} steps")
    state = {k: v.detach().float().cpu().numpy() for k, v in drafter.state_dict().items()}
    groups = [{k: v for k, v in state.items() if not k.startswith("layers.")}]
    groups += [{k: v for k, v in state.items() if k.startswith(f"layers.{i}.")} for i in range(len(drafter.layers))]
    for i, g in enumerate(groups):
        save_file(g, str(out / f"drafter-{i}.safetensors"))
    cfg = {k: v for k, v in dcfg.items() if k not in ("quantization", "draft_vocab_size")}
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    log("drafter written; held-out tau@16: " + ", ".join(
        f"{k} {tf_tau(drafter, dcfg, target, embed, v, mask_id, layer_ids, device):.3f}" for k, v in heldout.items()))
    files, part, size = [], [], 0
    for t, s, _ in made:  # files of at most SEQUENCE_BYTES raw, compressed: each comes back whole
        if size + 2 * len(t) > SEQUENCE_BYTES and part:
            files, part, size = files + [part], [], 0
        part, size = part + [(t, s)], size + 2 * len(t)
    room = max(RETURNED_FILES - len(groups) - 2, 0)  # beside the parts, config.json and log.txt
    files = (files + [part])[:room] if part else files[:room]
    for kept, part in enumerate(files):
        tokens, lengths, starts = pack(part)
        np.savez_compressed(out / f"sequences-{kept}.npz", tokens=tokens, lengths=lengths, response_starts=starts)
    kept = len(files)
    log(f"done: {step} steps, {len(made)} sequences made, {kept} sequence files written")
    return 0


def merge(a) -> int:
    import mlx.core as mx

    parts = Path(a.parts)
    weights = {}
    for name in sorted(parts.glob("drafter-*.safetensors")):
        weights.update(mx.load(str(name)))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((parts / "config.json").read_text())
    if a.draft_vocab:  # dflash train --draft-vocab's: the data's most frequent response tokens (FR-Spec)
        from dflash_mlx.train.data import frequent_tokens, load_sequences

        ids = frequent_tokens([s for d in a.data for s in load_sequences(d)], a.draft_vocab, config["vocab_size"])
        weights["d2t"], config["draft_vocab_size"] = ids - mx.arange(ids.size), ids.size
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"{out}: {len(weights)} tensors")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("prepare", help="token ids of the data, prompts and held-out sequences (MLX venv)")
    q.add_argument("--model", required=True, help="the target's mlx-lm folder (its tokenizer and config)")
    q.add_argument("--init", default=str(ROOT / "examples/smollm2-135m/drafter"), help="the drafter to start from")
    q.add_argument("--data", action="append", default=[], help="a `dflash data` folder to train on (repeatable)")
    q.add_argument("--prompts", action="append", default=[], help="a prompt file to regenerate there (repeatable)")
    q.add_argument("--heldout", action="append", default=[], help="a `dflash data` folder to report tau on")
    q.add_argument("--out", required=True)
    r = sub.add_parser("run", help="regenerate, train and write the drafter (PyTorch, CUDA)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("--gguf", required=True, help="the target's GGUF file (read with the gguf package)")
    r.add_argument("--inputs", required=True, help="the .npz `prepare` wrote")
    r.add_argument("--init", default=str(ROOT / "examples/smollm2-135m/drafter"), help="the drafter to start from")
    r.add_argument("--out", required=True, help="folder for the drafter's parts, config.json, log.txt, sequences")
    r.add_argument("--device", default="cuda", help="torch device (cpu: a slow check that it runs end to end)")
    r.add_argument("--seconds", type=float, default=520, help="the whole run's wall-clock budget")
    r.add_argument("--self-prompt-seconds", type=float, default=80,
                   help="when sampling the target's own user turns stops (from the start)")
    r.add_argument("--generate-seconds", type=float, default=260, help="when regeneration stops (from the start)")
    r.add_argument("--save-seconds", type=float, default=25, help="kept at the end for the evaluation and files")
    r.add_argument("--self-prompts", type=int, default=24576,
                   help="user turns the target samples itself (temperature 1), then answers greedily (0: none)")
    r.add_argument("--user-tokens", type=int, default=128, help="longest self-sampled user turn, in tokens")
    r.add_argument("--max-tokens", type=int, default=256, help="longest regenerated reply, in tokens")
    r.add_argument("--gen-batch", type=int, default=2048, help="sequences generated at once")
    r.add_argument("--seqs-per-step", type=int, default=32, help="sequences in a training step")
    r.add_argument("--anchors", type=int, default=64, help="blocks drawn from each sequence in a step")
    r.add_argument("--layers", type=int, default=0, help="grow the drafter to this many layers (0: as it is)")
    r.add_argument("--lr", type=float, default=4e-4, help="peak learning rate (AdamW)")
    r.add_argument("--warmup", type=float, default=0.05,
                   help="share of the training time warming up; then cosine down to 5%% of --lr as time runs out")
    r.add_argument("--log-every", type=int, default=100, help="steps between loss lines in log.txt")
    r.add_argument("--eval-every", type=int, default=500, help="steps between held-out tau lines")
    r.add_argument("--eval-sequences", type=int, default=16, help="held-out sequences per set tau is reported on")
    r.add_argument("--seed", type=int, default=0, help="seed of the sequences and anchors drawn")
    m = sub.add_parser("merge", help="join the parts `run` wrote into one drafter folder (MLX venv)")
    m.add_argument("--parts", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--draft-vocab", type=int, default=0,
                   help="draft only among the K most frequent response tokens of --data (0: the whole vocabulary)")
    m.add_argument("--data", action="append", default=[], help="the `dflash data` folders the drafter trained on")
    a = p.parse_args()
    return {"prepare": prepare, "run": run, "merge": merge}[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
