"""Moondream 2's layout (slipstream/models/moondream/) against a float64 re-implementation written in
this file from the public description (vikhyat/moondream `moondream/torch/*.py`; the PyPI `moondream`
package is a cloud client without the torch code, so it cannot serve as the oracle).

The oracle is dense: no paging, no chunks, an explicit [T, T] mask (causal, with the BOS + image
prefix attending both ways), explicit softmax, and the reference's rotary layout (rotate the halves,
write back interleaved). Random tiny weights (MoondreamConfig.tiny()) go through a safetensors folder
with the public tensor names and come back through load_moondream_folder.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from slipstream.errors import CorruptModelError
from slipstream.models.kernels.attention import AttentionMetadata, paged_attention_reference
from slipstream.models.base import ForwardBatch, KVCache
from slipstream.models.moondream.config import MoondreamConfig
from slipstream.models.moondream.image import overlap_crops, preprocess, select_tiling
from slipstream.models.moondream.model import MoondreamForCausalLM
from slipstream.models.moondream.region import coordinate_from_bin, fourier_features, size_from_bin
from slipstream.models.moondream.vision import stitch_crops
from slipstream.models.moondream.weights import load_moondream_folder

PIL = pytest.importorskip("PIL.Image")
D = torch.float64
CFG = MoondreamConfig.tiny()


# --- random weights with the public names --------------------------------------------------------


def random_weights(config: MoondreamConfig, seed: int) -> dict[str, torch.Tensor]:
    """float64 tensors in our (= the reference's current) module names, at scales that keep
    activations O(1), so argmaxes are well separated."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in MoondreamForCausalLM(config).state_dict().items()}
    out = {}
    for name, shape in shapes.items():
        r = torch.randn(shape, generator=g, dtype=D)
        if name.endswith("_features"):  # Fourier frequencies
            out[name] = r
        elif name.endswith((".ln.weight", "ln1.weight", "ln2.weight", "post_ln.weight")):
            out[name] = 1 + 0.1 * r
        elif name.endswith(".bias"):
            out[name] = 0.1 * r
        elif len(shape) == 2 and not name.endswith("wte"):
            out[name] = r / math.sqrt(shape[1])
        else:  # wte, pos_emb
            out[name] = 0.5 * r
    return out


def legacy_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The earlier public naming (vision_encoder... / text_model... / region_model...), written from
    the reference's weights.py, with its transposed Fourier matrices."""
    out = {}
    for name, t in weights.items():
        parts = name.split(".")
        if name == "vision.pos_emb":
            out["vision_encoder.encoder.model.visual.pos_embed"] = t
        elif name == "text.wte":
            out["text_model.transformer.embd.wte.weight"] = t
        elif name.startswith("region.") and name.endswith("_features"):
            kind = {"coord_features": "coordinate", "size_features": "size"}[parts[1]]
            out[f"region_model.{kind}_features.weight"] = t.T.contiguous()
        elif parts[0] == "vision" and parts[1] == "blocks":
            sub = {"ln1": "norm1", "ln2": "norm2"}.get(parts[3], parts[3])
            out[".".join(["vision_encoder.encoder.model.visual.blocks", parts[2], sub] + parts[4:])] = t
        elif parts[0] == "vision":
            head = {"patch_emb": "vision_encoder.encoder.model.visual.patch_embed.linear",
                    "post_ln": "vision_encoder.encoder.model.visual.norm",
                    "proj_mlp": "vision_encoder.projection.mlp"}[parts[1]]
            out[".".join([head] + parts[2:])] = t
        elif parts[0] == "text" and parts[1] == "blocks":
            sub = {"ln": ["ln"], "attn": ["mixer"], "mlp": ["mlp"]}[parts[3]]
            rest = [{"qkv": "Wqkv", "proj": "out_proj"}.get(p, p) for p in parts[4:]]
            out[".".join(["text_model.transformer.h", parts[2]] + sub + rest)] = t
        elif parts[0] == "text":
            head = {"post_ln": "text_model.lm_head.ln", "lm_head": "text_model.lm_head.linear"}[parts[1]]
            out[".".join([head] + parts[2:])] = t
        else:  # region encoders / decoders
            kind = {"coord_encoder": "coordinate_encoder", "coord_decoder": "coordinate_decoder",
                    "size_encoder": "size_encoder", "size_decoder": "size_decoder"}[parts[1]]
            out[".".join(["region_model", kind] + parts[2:])] = t
    return out


def save_folder(path, weights: dict[str, torch.Tensor], naming: str, config_sections: dict | None = None):
    from safetensors.torch import save_file

    named = legacy_names(weights) if naming == "legacy" else {"model." + k: v for k, v in weights.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in named.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "moondream1", "config": config_sections or {}}))
    return path


def tiny_sections(c: MoondreamConfig) -> dict:
    """The tiny layout in the reference's config.json field names."""
    v, t, r = c.vision, c.text, c.region
    return {"vision": {"enc_dim": v.hidden_size, "enc_patch_size": v.patch_size, "enc_n_layers": v.num_layers,
                       "enc_ff_dim": v.intermediate_size, "enc_n_heads": v.num_heads, "proj_out_dim": v.proj_out_size,
                       "crop_size": v.crop_size, "max_crops": v.max_crops, "overlap_margin": v.overlap_margin,
                       "proj_inner_dim": v.proj_inner_size},
            "text": {"dim": t.hidden_size, "ff_dim": t.intermediate_size, "n_layers": t.num_layers,
                     "vocab_size": t.vocab_size, "max_context": t.max_position_embeddings, "n_heads": t.num_heads,
                     "n_kv_heads": t.num_kv_heads, "prefix_attn": c.prefix_len},
            "region": {"dim": t.hidden_size, "coord_feat_dim": r.coord_feat_dim, "coord_out_dim": r.coord_bins,
                       "size_feat_dim": r.size_feat_dim, "size_out_dim": 2 * r.size_bins, "inner_dim": r.inner_size},
            # (the reference's BOS/EOS, 50256, is outside the tiny vocabulary)
            "tokenizer": {"bos_id": t.bos_token_id, "eos_id": t.eos_token_ids[0]}}


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=0)


@pytest.fixture(scope="module")
def model(weights, tmp_path_factory):
    folder = save_folder(tmp_path_factory.mktemp("md") / "moondream-tiny", weights, "current", tiny_sections(CFG))
    return load_moondream_folder(folder, dtype=D)


# --- the float64 oracle ---------------------------------------------------------------------------


def r_linear(x, w, name):
    return x @ w[name + ".weight"].T + w[name + ".bias"]


def r_ln(x, w, name, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]


def r_gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def r_mlp(x, w, name):
    return r_linear(r_gelu_tanh(r_linear(x, w, name + ".fc1")), w, name + ".fc2")


def r_attention(q, k, v, mask):  # [H, T, Dh] each; mask [T, T] bool
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def r_vision_block(x, w, i, heads):  # x [T, D] one crop
    p = f"vision.blocks.{i}"
    t, d = x.shape
    q, k, v = r_linear(r_ln(x, w, p + ".ln1"), w, p + ".attn.qkv").chunk(3, -1)
    split = lambda a: a.view(t, heads, d // heads).transpose(0, 1)  # noqa: E731
    a = r_attention(split(q), split(k), split(v), torch.ones(t, t, dtype=torch.bool)).transpose(0, 1).reshape(t, d)
    x = x + r_linear(a, w, p + ".attn.proj")
    return x + r_mlp(r_ln(x, w, p + ".ln2"), w, p + ".mlp")


def r_encode_crop(pixels, w, c: MoondreamConfig):  # [3, H, W] -> [grid², D]
    v = c.vision
    p, g = v.patch_size, v.grid
    patches = [pixels[:, r * p:(r + 1) * p, cc * p:(cc + 1) * p].reshape(-1) for r in range(g) for cc in range(g)]
    x = r_linear(torch.stack(patches), w, "vision.patch_emb") + w["vision.pos_emb"][0]
    for i in range(v.num_layers):
        x = r_vision_block(x, w, i, v.num_heads)
    return r_ln(x, w, "vision.post_ln")


def r_stitch(local, tiling, margin):  # local [n, g, g, D]: keep each crop's part by explicit ownership
    rows, cols = tiling
    g = local.shape[1]
    step = g - 2 * margin
    out = torch.full((step * rows + 2 * margin, step * cols + 2 * margin, local.shape[-1]), float("nan"), dtype=local.dtype)
    for y in range(out.shape[0]):
        for x in range(out.shape[1]):
            # the crop whose inner window (or outer border) holds this cell
            r = min(max((y - margin) // step, 0), rows - 1)
            cc = min(max((x - margin) // step, 0), cols - 1)
            out[y, x] = local[r * cols + cc, y - r * step, x - cc * step]
    return out


def r_pool(grid, size):  # [H, W, D] -> [size, size, D], torch's adaptive average windows
    h, w = grid.shape[:2]
    out = torch.empty(size, size, grid.shape[-1], dtype=grid.dtype)
    for i in range(size):
        for j in range(size):
            y0, y1 = (i * h) // size, -(-((i + 1) * h) // size)
            x0, x1 = (j * w) // size, -(-((j + 1) * w) // size)
            out[i, j] = grid[y0:y1, x0:x1].mean((0, 1))
    return out


def r_image(pixels, tiling, w, c: MoondreamConfig):  # -> [grid², text D]
    v = c.vision
    feats = torch.stack([r_encode_crop(p, w, c) for p in pixels])
    local = feats[1:].view(-1, v.grid, v.grid, v.hidden_size)
    pooled = r_pool(r_stitch(local, tiling, v.overlap_margin), v.grid).reshape(-1, v.hidden_size)
    return r_mlp(torch.cat([feats[0], pooled], -1), w, "vision.proj_mlp")


def r_rotary(x, positions, rot, theta):  # [H, T, Dh]: the reference's layout (halves in, interleaved out)
    freqs = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=D) / rot)
    ang = positions.to(D)[:, None] * freqs[None, :]
    cos, sin = ang.cos(), ang.sin()
    xr, xi = x[..., : rot // 2], x[..., rot // 2: rot]
    out = torch.stack([xr * cos - xi * sin, xr * sin + xi * cos], -1).flatten(-2)
    return torch.cat([out, x[..., rot:]], -1)


def r_prefix_mask(t, prefix):
    m = torch.tril(torch.ones(t, t, dtype=torch.bool))
    m[:prefix, :prefix] = True
    return m


def r_text_block(x, w, i, c: MoondreamConfig, mask):  # x [T, D] the whole sequence
    t_cfg = c.text
    p = f"text.blocks.{i}"
    t, d = x.shape
    hd = t_cfg.head_dim
    h = r_ln(x, w, p + ".ln")
    q, k, v = r_linear(h, w, p + ".attn.qkv").split([t_cfg.num_heads * hd, t_cfg.num_kv_heads * hd,
                                                     t_cfg.num_kv_heads * hd], -1)
    pos = torch.arange(t)
    q = r_rotary(q.view(t, -1, hd).transpose(0, 1), pos, t_cfg.rotary_dim, t_cfg.rope_theta)
    k = r_rotary(k.view(t, -1, hd).transpose(0, 1), pos, t_cfg.rotary_dim, t_cfg.rope_theta)
    a = r_attention(q, k, v.view(t, -1, hd).transpose(0, 1), mask).transpose(0, 1).reshape(t, d)
    return x + r_linear(a, w, p + ".attn.proj") + r_mlp(h, w, p + ".mlp")


def r_hidden(embeds, w, c: MoondreamConfig, prefix):  # [T, D] -> [T, D] before post_ln
    mask = r_prefix_mask(embeds.shape[0], prefix)
    x = embeds
    for i in range(c.text.num_layers):
        x = r_text_block(x, w, i, c, mask)
    return x


def r_logits(hidden, w):
    return r_linear(r_ln(hidden, w, "text.post_ln"), w, "text.lm_head")


def r_fourier(x, freqs):
    f = 2 * math.pi * x @ freqs
    return torch.cat([f.cos(), f.sin()], -1)


def r_encode_coord(value, w):
    return r_linear(r_fourier(torch.tensor([[value]], dtype=D), w["region.coord_features"]), w, "region.coord_encoder")[0]


def r_encode_size(wh, w):
    return r_linear(r_fourier(torch.tensor([wh], dtype=D), w["region.size_features"]), w, "region.size_encoder")[0]


def r_decode_coord(hidden, w):  # the reference: argmax / number of bins
    logits = r_mlp(hidden, w, "region.coord_decoder")
    return int(logits.argmax()) / logits.shape[-1]


def r_decode_size(hidden, w):  # the reference: 2 ** ((bin / 1023) * 10 - 10) with 1023 = bins - 1
    logits = r_mlp(hidden, w, "region.size_decoder").view(2, -1)
    bins = logits.shape[-1]
    return tuple(2.0 ** ((int(b) / (bins - 1)) * 10 - 10) for b in logits.argmax(-1))


# --- driving our model through the paged forward ----------------------------------------------------


PAGE = 4


class Paged:
    """One sequence on a shuffled page table; each call forwards one chunk and samples its last row."""

    def __init__(self, model, prefix: int, num_pages: int = 16, seed: int = 1, dtype=D, device="cpu"):
        self.model, self.prefix, self.device = model, prefix, torch.device(device)
        self.pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.kv = KVCache(model.config, num_pages, PAGE, dtype, self.device)
        self.kv.k.fill_(float("nan"))  # attention must never read a slot no forward wrote
        self.kv.v.fill_(float("nan"))
        self.pos = 0

    def step(self, ids, embeds: dict[int, torch.Tensor] | None = None):
        q, dev = len(ids), self.device
        positions = torch.arange(self.pos, self.pos + q, device=dev)
        kv_indices = torch.tensor([self.pages[p // PAGE] * PAGE + p % PAGE for p in positions.tolist()], device=dev)
        meta = AttentionMetadata(query_start=[0, q], kv_lens=[self.pos + q], page_tables=[self.pages], page_size=PAGE,
                                 bidirectional_lens=[self.prefix])
        batch = ForwardBatch(input_ids=torch.tensor(ids, device=dev), positions=positions, kv_indices=kv_indices,
                             sample_indices=torch.tensor([q - 1], device=dev), attn=meta)
        if embeds:  # issue 30's embedding override (set as attributes: this branch's ForwardBatch may predate it)
            batch.embed_rows = torch.tensor(sorted(embeds), device=dev)
            batch.embeds = torch.stack([embeds[r] for r in sorted(embeds)]).to(dev)
        self.pos += q
        logits, hidden = self.model.forward_hidden(batch, self.kv)
        return logits[0], hidden[0]


def image_prompt(model, image, text_ids):
    """ids and embedding overrides of [BOS, image tokens..., text]; and the oracle's embeddings."""
    c = model.moondream_config
    processed = model.preprocess(image)
    feats = model.encode_image(processed)
    n = feats.shape[0]
    ids = [c.text.bos_token_id] + [c.text.image_token_id] * n + list(text_ids)
    embeds = {1 + i: feats[i] for i in range(n)}
    return ids, embeds, processed


def sample_image():
    rng = np.random.default_rng(0)
    return PIL.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8))


# --- layers ---------------------------------------------------------------------------------------------


def test_vision_block_equals_the_oracle(model, weights):
    x = torch.randn(2, CFG.vision.tokens_per_image, CFG.vision.hidden_size, dtype=D, generator=torch.Generator().manual_seed(3))
    ours = model.vision.blocks[1](x)
    for n in range(2):
        torch.testing.assert_close(ours[n], r_vision_block(x[n], weights, 1, CFG.vision.num_heads), rtol=1e-10, atol=1e-10)


def test_stitching_keeps_each_cell_from_the_crop_that_owns_it():
    local = torch.randn(6, CFG.vision.grid, CFG.vision.grid, 3, dtype=D)
    for tiling in ((2, 3), (3, 2), (1, 1)):
        n = tiling[0] * tiling[1]
        assert torch.equal(stitch_crops(local[:n], tiling, 1), r_stitch(local[:n], tiling, 1))


def test_image_embeddings_equal_the_oracle(model, weights):
    processed = preprocess(sample_image(), CFG.vision)
    assert processed.tiling == (1, 2) and processed.pixel_values.shape == (3, 3, 28, 28)
    ours = model.encode_image(processed)
    assert ours.shape == (CFG.vision.tokens_per_image, CFG.text.hidden_size)
    ref = r_image(processed.pixel_values.to(D), processed.tiling, weights, CFG)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)


def test_projection_reads_global_then_pooled_local(model, weights):
    """The projection's input order matters: swapping [global, local] changes the output."""
    g, d = CFG.vision.grid, CFG.vision.hidden_size
    feats = torch.randn(5, g * g, d, dtype=D, generator=torch.Generator().manual_seed(4))
    ours = model.vision.project(feats, (2, 2))
    pooled = r_pool(r_stitch(feats[1:].view(-1, g, g, d), (2, 2), 1), g).reshape(-1, d)
    torch.testing.assert_close(ours, r_mlp(torch.cat([feats[0], pooled], -1), weights, "vision.proj_mlp"))
    assert not torch.allclose(ours, r_mlp(torch.cat([pooled, feats[0]], -1), weights, "vision.proj_mlp"))


def test_text_block_partial_rotary_and_parallel_residual(model, weights):
    """One block over a whole sequence, through the paged forward, equals the oracle block (rotary on
    the first rotary_dim dims of each head only, in the reference's interleaved layout; x + attn + mlp
    from one LayerNorm)."""
    t = 11
    x = torch.randn(t, CFG.text.hidden_size, dtype=D, generator=torch.Generator().manual_seed(5))
    runner = Paged(model, prefix=0)
    meta = AttentionMetadata(query_start=[0, t], kv_lens=[t], page_tables=[runner.pages], page_size=PAGE)
    positions = torch.arange(t)
    batch = ForwardBatch(input_ids=torch.zeros(t, dtype=torch.long), positions=positions,
                         kv_indices=torch.tensor([runner.pages[p // PAGE] * PAGE + p % PAGE for p in range(t)]),
                         sample_indices=positions, attn=meta)
    ours = model.text.blocks[0](x, batch, runner.kv, model.text.rope.for_positions(positions, D))
    torch.testing.assert_close(ours, r_text_block(x, weights, 0, CFG, r_prefix_mask(t, 0)), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("prefix", [0, 1, 5, 9])
def test_bidirectional_prefix_in_one_chunk_and_later_chunks(prefix):
    """Attention with a bidirectional prefix equals dense attention under the oracle's mask, with the
    prefix in the first chunk and the rest split over later chunks; prefix 0 is plain causal,
    bitwise equal to metadata without the field."""
    g = torch.Generator().manual_seed(prefix)
    t, heads, hd = 13, 2, 8
    q, k, v = (torch.randn(t, heads, hd, dtype=D, generator=g) for _ in range(3))
    pages = [3, 0, 2, 1]
    slot = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(t)])
    k_cache = torch.full((16, heads, hd), float("nan"), dtype=D)
    v_cache = torch.full((16, heads, hd), float("nan"), dtype=D)
    k_cache[slot], v_cache[slot] = k, v
    ref = r_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), r_prefix_mask(t, prefix)).transpose(0, 1)
    for cuts in ([0, t], [0, max(prefix, 1), t], [0, max(prefix, 1), 11, 12, t]):
        out = torch.zeros_like(q)
        for lo, hi in zip(cuts, cuts[1:]):
            meta = AttentionMetadata([0, hi - lo], [hi], [pages], PAGE, bidirectional_lens=[prefix])
            paged_attention_reference(q[lo:hi], k_cache, v_cache, meta, out[lo:hi])
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        if prefix == 0:
            plain = torch.zeros_like(q)
            for lo, hi in zip(cuts, cuts[1:]):
                paged_attention_reference(q[lo:hi], k_cache, v_cache, AttentionMetadata([0, hi - lo], [hi], [pages], PAGE),
                                          plain[lo:hi])
            assert torch.equal(out, plain)
    # a chunk may start inside the prefix when its first positions are reused from a cache (their K/V
    # were computed with the whole prefix), as long as it reaches the prefix end
    out = torch.zeros_like(q)
    meta = AttentionMetadata([0, t - 2], [t], [pages], PAGE, bidirectional_lens=[prefix])
    paged_attention_reference(q[2:], k_cache, v_cache, meta, out[2:])
    torch.testing.assert_close(out[2:], ref[2:], rtol=1e-12, atol=1e-12)


def test_bidirectional_prefix_beside_plain_sequences_and_its_refusal():
    """Two sequences in one step, one with a prefix and one without, each equal its own dense
    attention; a chunk that ends inside a prefix is refused (a later key cannot be seen yet)."""
    g = torch.Generator().manual_seed(7)
    heads, hd = 2, 8
    lens, prefixes, pages = [9, 6], [6, 0], [[0, 1, 2], [3, 4]]
    k_cache = torch.randn(20, heads, hd, dtype=D, generator=g)
    v_cache = torch.randn(20, heads, hd, dtype=D, generator=g)
    q = torch.randn(sum(lens), heads, hd, dtype=D, generator=g)
    out = torch.zeros_like(q)
    meta = AttentionMetadata([0, 9, 15], lens, pages, PAGE, bidirectional_lens=prefixes)
    paged_attention_reference(q, k_cache, v_cache, meta, out)
    lo = 0
    for n, prefix, p in zip(lens, prefixes, pages):
        idx = torch.tensor([p[i // PAGE] * PAGE + i % PAGE for i in range(n)])
        ref = r_attention(q[lo:lo + n].transpose(0, 1), k_cache[idx].transpose(0, 1), v_cache[idx].transpose(0, 1),
                          r_prefix_mask(n, prefix)).transpose(0, 1)
        torch.testing.assert_close(out[lo:lo + n], ref, rtol=1e-12, atol=1e-12)
        lo += n
    with pytest.raises(ValueError, match="splits its bidirectional prefix"):
        paged_attention_reference(q[:4], k_cache, v_cache, AttentionMetadata([0, 4], [4], [pages[0]], PAGE,
                                                                             bidirectional_lens=[6]), out[:4])


def test_region_encoders_and_decoders_equal_the_oracle(model, weights):
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(5, CFG.text.hidden_size, dtype=D, generator=g)
    coords = model.region.decode_coordinate(hidden)
    sizes = model.region.decode_size(hidden)
    assert coords.dtype == torch.float32 and coords.shape == (5,) and sizes.shape == (5, 2)
    for n in range(5):
        assert coords[n].item() == r_decode_coord(hidden[n], weights)
        assert tuple(sizes[n].tolist()) == pytest.approx(r_decode_size(hidden[n], weights), rel=1e-6)
    values = torch.tensor([0.0, 0.25, 0.77, 1023 / 1024])
    torch.testing.assert_close(model.region.encode_coordinate(values),
                               torch.stack([r_encode_coord(float(x), weights) for x in values]))
    wh = torch.tensor([[0.5, 0.125], [2 ** -10, 1.0]])
    torch.testing.assert_close(model.region.encode_size(wh), torch.stack([r_encode_size(x.tolist(), weights) for x in wh]))


@pytest.mark.parametrize("fn", ["size", "coordinate", "fourier"])
def test_region_values_do_not_depend_on_the_batch(fn):
    """A row's value is the same alone and at any place in a batch of any length (float32, as the
    engine runs them): the CPU's vector lanes and scalar tail round exp2 differently, which made
    depth 2's detect sizes differ from depth 1's by an ulp where the batches differed."""
    bins = torch.arange(1024).repeat(2)[torch.randperm(2048, generator=torch.Generator().manual_seed(0))]
    freqs = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    one = {"size": lambda b: size_from_bin(b, 1024), "coordinate": lambda b: coordinate_from_bin(b, 1024),
           "fourier": lambda b: fourier_features(coordinate_from_bin(b, 1024).reshape(-1, 1), freqs)}[fn]
    alone = torch.cat([one(bins[i:i + 1]) for i in range(len(bins))])
    for n in (2, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 2048):
        for start in (0, 1, 5):
            got = torch.cat([one(bins[i:i + n]) for i in range(start, len(bins), n)])
            assert torch.equal(got, alone[start * (alone.shape[0] // len(bins)):]), (fn, n, start)


def test_bins_to_values():
    """Coordinates: bin / bins, as the public reference (not kestrel's bin / (bins - 1)); sizes: the
    log scale 2^((bin / (bins - 1)) * 10 - 10), from 2^-10 to 1."""
    bins = torch.tensor([0, 1, 512, 1023])
    assert coordinate_from_bin(bins, 1024).tolist() == [0.0, 1 / 1024, 0.5, 1023 / 1024]
    sizes = size_from_bin(bins, 1024)
    assert sizes[0].item() == 2 ** -10 and sizes[3].item() == 1.0
    assert sizes[2].item() == pytest.approx(2 ** (512 / 1023 * 10 - 10), rel=1e-6)


# --- preprocessing ----------------------------------------------------------------------------------------


def test_select_tiling_cases():
    # the released layout: 378-px crops, 4-patch margins -> 266-px windows, at most 12 crops
    assert select_tiling(300, 300, 266, 12) == (3, 3)  # square: floor(sqrt(12)) each way
    assert select_tiling(200, 5000, 266, 12) == (1, 1)  # a side within one window
    assert select_tiling(700, 2000, 266, 12) == (2, 5)  # 3x8 needed > 12: both scaled by sqrt(12/24), floored
    assert select_tiling(600, 1000, 266, 12) == (3, 4)  # aspect grid 2x4, raised to the 3 rows needed
    assert select_tiling(300, 1300, 266, 12) == (2, 6)  # aspect 1x7 raised to 2x7 > 12: columns given back


def test_crops_are_windows_of_the_resized_image_with_overlap():
    """An image already at the target size is cut, not resampled: crop (r, c) is the crop-sized
    square at (r, c) * window, so neighbours share 2 * margin pixels; values scale to [-1, 1]."""
    v = CFG.vision
    window = v.crop_size - 2 * v.overlap_margin * v.patch_size  # 14
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, (2 * window + 14, 2 * window + 14, 3), dtype=np.uint8)
    crops, tiling = overlap_crops(PIL.fromarray(arr), v)
    assert tiling == (2, 2) and crops.shape == (5, 28, 28, 3)
    for r in range(2):
        for c in range(2):
            assert np.array_equal(crops[1 + r * 2 + c], arr[r * window: r * window + 28, c * window: c * window + 28])
    assert np.array_equal(crops[0], np.asarray(PIL.fromarray(arr).resize((28, 28), PIL.Resampling.LANCZOS)))
    px = preprocess(PIL.fromarray(arr), v).pixel_values
    torch.testing.assert_close(px, torch.from_numpy(crops.transpose(0, 3, 1, 2)).float() / 127.5 - 1)


# --- the whole model --------------------------------------------------------------------------------------


def test_logits_of_an_image_prompt_equal_the_oracle(model, weights):
    """BOS + image tokens + text, prefilled in chunks (the whole prefix in the first), then a decode
    step: the sampled logits equal the oracle's dense pass with the bidirectional prefix."""
    ids, embeds, processed = image_prompt(model, sample_image(), [17, 40, 3, 99, 5 + 60])
    prefix = CFG.prefix_len
    runner = Paged(model, prefix=prefix)
    first, _ = runner.step(ids[:prefix + 2], {r: e for r, e in embeds.items() if r < prefix + 2})
    second, _ = runner.step(ids[prefix + 2:])
    third, _ = runner.step([42])

    ref_img = r_image(processed.pixel_values.to(D), processed.tiling, weights, CFG)
    wte = weights["text.wte"]
    all_ids = ids + [42]
    ref_embeds = torch.stack([ref_img[p - 1] if 1 <= p < prefix else wte[i] for p, i in enumerate(all_ids)])
    ref_logits = r_logits(r_hidden(ref_embeds, weights, CFG, prefix), weights)
    for ours, at in ((first, prefix + 1), (second, len(ids) - 1), (third, len(ids))):
        torch.testing.assert_close(ours, ref_logits[at].float(), rtol=1e-5, atol=1e-5)
    # the prefix must attend both ways: a causal prefix gives other logits
    causal = r_logits(r_hidden(ref_embeds, weights, CFG, prefix=0), weights)
    assert (causal[len(ids)] - ref_logits[len(ids)]).abs().max() > 1e-3


@pytest.mark.parametrize("skill", ["point", "detect"])
def test_point_and_detect_sequences_driven_by_hand(model, weights, skill):
    """The region loop as the reference runs it, two objects: x is decoded from the hidden state that
    chose the coordinate token and fed back as encode_coordinate(x); y likewise; for detect the size
    is decoded from the step after y and fed back as encode_size. Every decoded value and the final
    logits equal the oracle's."""
    c = CFG
    ids, embeds, processed = image_prompt(model, sample_image(), [7, 8, 9, 3])
    runner = Paged(model, prefix=c.prefix_len, num_pages=24)
    logits, hidden = runner.step(ids, embeds)

    ref_img = r_image(processed.pixel_values.to(D), processed.tiling, weights, c)
    wte = weights["text.wte"]
    seq = [ref_img[p - 1] if 1 <= p < c.prefix_len else wte[i] for p, i in enumerate(ids)]

    def ref_last():
        h = r_hidden(torch.stack(seq), weights, c, c.prefix_len)[-1]
        return r_logits(h, weights), h

    ref_logits, ref_h = ref_last()
    torch.testing.assert_close(logits, ref_logits.float(), rtol=1e-5, atol=1e-5)
    ours_values, ref_values = [], []
    for _ in range(2):
        for _axis in "xy":
            value = model.region.decode_coordinate(hidden[None])
            ours_values.append(value.item())
            ref_value = r_decode_coord(ref_h, weights)
            ref_values.append(ref_value)
            logits, hidden = runner.step([c.coord_token_id], {0: model.region.encode_coordinate(value)[0]})
            seq.append(r_encode_coord(ref_value, weights))
            ref_logits, ref_h = ref_last()
        if skill == "detect":
            wh = model.region.decode_size(hidden[None])
            ours_values += wh[0].tolist()
            ref_wh = r_decode_size(ref_h, weights)
            ref_values += list(ref_wh)
            logits, hidden = runner.step([c.size_token_id], {0: model.region.encode_size(wh)[0]})
            seq.append(r_encode_size(list(ref_wh), weights))
            ref_logits, ref_h = ref_last()
        torch.testing.assert_close(logits, ref_logits.float(), rtol=1e-5, atol=1e-5)
    assert ours_values == pytest.approx(ref_values, rel=1e-6, abs=0)
    assert len(set(ours_values)) > 2  # the random weights decode distinct values: a real check


# --- loading -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("naming", ["current", "legacy"])
def test_folder_round_trip_in_both_public_namings(tmp_path, weights, naming):
    folder = save_folder(tmp_path / naming, weights, naming, tiny_sections(CFG))
    loaded = load_moondream_folder(folder, dtype=D)
    assert loaded.moondream_config.vision == CFG.vision and loaded.moondream_config.region == CFG.region
    assert loaded.config.rotary_dim == CFG.text.rotary_dim  # derived as the reference does: dim / (2 * heads)
    state = loaded.state_dict()
    assert set(state) == set(weights)
    for name, t in weights.items():
        assert torch.equal(state[name], t), name


def test_folder_with_a_missing_tensor_or_unknown_field_is_refused(tmp_path, weights):
    partial = {k: v for k, v in weights.items() if k != "text.blocks.1.mlp.fc2.bias"}
    with pytest.raises(CorruptModelError, match="text.blocks.1.mlp.fc2.bias"):
        load_moondream_folder(save_folder(tmp_path / "a", partial, "current", tiny_sections(CFG)), dtype=D)
    sections = tiny_sections(CFG)
    sections["text"]["n_expertz"] = 3
    with pytest.raises(CorruptModelError, match="n_expertz"):
        load_moondream_folder(save_folder(tmp_path / "b", weights, "current", sections), dtype=D)


def test_released_config_sizes():
    c = MoondreamConfig.from_reference_dict({})
    assert (c.vision.grid, c.vision.tokens_per_image, c.prefix_len) == (27, 729, 730)
    assert (c.text.bos_token_id, c.text.eos_token_ids) == (50256, (50256,))  # the reference's, not 0
    assert (c.query_prefix, c.query_suffix) == ((198, 198, 24361, 25), (198, 198, 33706, 25))
    assert (c.text.head_dim, c.text.rotary_dim, c.text.vocab_size, c.text.num_layers) == (64, 32, 51200, 24)
    assert (c.region.coord_bins, c.region.size_bins, c.region.coord_feat_dim, c.region.size_feat_dim) == (1024, 1024, 256, 512)
    with torch.device("meta"):
        m = MoondreamForCausalLM(c)
    assert m.region.coord_encoder.weight.shape == (2048, 256) and m.region.size_decoder.fc2.weight.shape == (2048, 8192)
    assert m.vision.proj_mlp.fc1.weight.shape == (8192, 2 * 1152) and m.vision.patch_emb.weight.shape == (1152, 588)
    assert m.text.blocks[0].attn.qkv.weight.shape == (3 * 2048, 2048)


@pytest.mark.cuda
def test_cuda_logits_and_region_heads_without_a_host_sync(weights):
    """On a GPU: the float32 model's logits of an image prompt match the float64 CPU model, and the
    region heads (decode and encode) run with torch's sync debug mode set to error, i.e. no
    device-to-host read."""
    cuda = torch.device("cuda")
    cpu_model = MoondreamForCausalLM.from_weights(CFG, dict(weights), D, "cpu")
    gpu_model = MoondreamForCausalLM.from_weights(CFG, {k: v.float() for k, v in weights.items()}, torch.float32, cuda)
    ids, embeds, _ = image_prompt(cpu_model, sample_image(), [7, 8, 9, 3])
    ref_logits, ref_hidden = Paged(cpu_model, prefix=CFG.prefix_len).step(ids, embeds)

    gpu = Paged(gpu_model, prefix=CFG.prefix_len, dtype=torch.float32, device=cuda)
    logits, hidden = gpu.step(ids, {r: e.float() for r, e in embeds.items()})
    torch.testing.assert_close(logits.cpu(), ref_logits.float(), rtol=1e-3, atol=1e-3)
    hidden = hidden[None].repeat(4, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = gpu_model.region.decode_coordinate(hidden)
        wh = gpu_model.region.decode_size(hidden)
        e = gpu_model.region.encode_coordinate(x) + gpu_model.region.encode_size(wh)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert e.device.type == "cuda" and e.shape == (4, CFG.text.hidden_size)
    assert x.cpu()[0].item() == cpu_model.region.decode_coordinate(ref_hidden[None]).item()
