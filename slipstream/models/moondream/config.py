"""Moondream 2's hyper-parameters: the vision encoder, the Phi-style text decoder, the region heads.

Defaults are the released moondream2 sizes (from the public reference, vikhyat/moondream
`moondream/torch/config.py`); `MoondreamConfig.tiny()` is the same layout shrunk for tests. The text
section uses ModelConfig's field names (num_layers, num_kv_heads, head_dim, ...) so the runtime's
KVCache and planner read it unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import cast

from slipstream.errors import CorruptModelError


REFERENCE_EOS = 50256  # the reference's TokenizerConfig bos_id and eos_id


@dataclass(frozen=True)
class MoondreamVisionConfig:
    crop_size: int = 378
    patch_size: int = 14
    num_layers: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    max_crops: int = 12
    overlap_margin: int = 4  # in patches, on each side of a local crop
    proj_inner_size: int = 8192
    proj_out_size: int = 2048  # the text width
    layer_norm_eps: float = 1e-5

    @property
    def grid(self) -> int:
        """Patches along one side of a crop (27)."""
        return self.crop_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        return self.grid * self.grid

    def validate(self) -> None:
        if self.crop_size % self.patch_size:
            raise ValueError(f"vision crop_size {self.crop_size} is not a multiple of patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if 2 * self.overlap_margin >= self.grid:
            raise ValueError(f"vision overlap_margin {self.overlap_margin} leaves no window in a {self.grid}-patch crop")


@dataclass(frozen=True)
class MoondreamTextConfig:
    vocab_size: int = 51200
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_layers: int = 24
    num_heads: int = 32
    num_kv_heads: int = 32
    rotary_dim: int = 32  # rotary on the first rotary_dim dims of each head (the reference: hidden / (2 * heads))
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    bos_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (0,)
    name: str = "moondream2"
    architecture: str = "moondream"
    # The placeholder id of image positions in a prompt; their embeddings are replaced by the image
    # features, so any id works: the default (None) is the last row, one of the padding rows past
    # the tokenizer's ids, which ordinary text never produces.
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.image_token_id is None:
            object.__setattr__(self, "image_token_id", self.vocab_size - 1)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def tie_word_embeddings(self) -> bool:
        return False

    def kv_window(self) -> None:
        """Every layer attends to the whole context: no page is given back early (ModelConfig.kv_window)."""
        return None

    def validate(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"text hidden_size {self.hidden_size}, num_heads {self.num_heads}, num_kv_heads "
                             f"{self.num_kv_heads}: heads must divide the width and kv heads the heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"text rotary_dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if not all(0 <= i < self.vocab_size for i in (self.bos_token_id, *self.eos_token_ids)):
            raise ValueError(f"text bos_token_id {self.bos_token_id} / eos_token_ids {self.eos_token_ids} are outside "
                             f"the vocabulary of {self.vocab_size}")
        if not 0 <= cast(int, self.image_token_id) < self.vocab_size:  # (set just above)
            raise ValueError(f"text image_token_id {self.image_token_id} is outside the vocabulary of {self.vocab_size}")


@dataclass(frozen=True)
class MoondreamRegionConfig:
    coord_feat_dim: int = 256  # cos and sin of 128 frequencies of one coordinate
    coord_bins: int = 1024
    size_feat_dim: int = 512  # cos and sin of 256 frequencies of (width, height)
    size_bins: int = 1024  # per side: the size decoder emits 2 * size_bins logits
    inner_size: int = 8192

    def validate(self) -> None:
        if self.coord_feat_dim % 2 or self.size_feat_dim % 2:
            raise ValueError("region feature dims must be even (cos and sin halves)")


@dataclass(frozen=True)
class MoondreamConfig:
    vision: MoondreamVisionConfig = field(default_factory=MoondreamVisionConfig)
    text: MoondreamTextConfig = field(default_factory=MoondreamTextConfig)
    region: MoondreamRegionConfig = field(default_factory=MoondreamRegionConfig)
    coord_token_id: int = 5  # "a coordinate comes next": its input embedding is the encoded value
    size_token_id: int = 6
    # the reference's `query` template: its token ids before " " + question, and after it
    # ("\n\nQuestion:" and "\n\nAnswer:" in moondream2's tokenizer)
    query_prefix: tuple[int, ...] = (198, 198, 24361, 25)
    query_suffix: tuple[int, ...] = (198, 198, 33706, 25)
    # the region skills' templates: prefix ids, then " " + the object's tokens, then suffix ids
    # ("\n\nPoint:" / "\n\nDetect:" and "\n\n"); None: the folder's model has no such skill
    point_template: tuple[tuple[int, ...], tuple[int, ...]] | None = ((198, 198, 12727, 25), (628,))
    detect_template: tuple[tuple[int, ...], tuple[int, ...]] | None = ((198, 198, 47504, 25), (628,))

    def __post_init__(self) -> None:
        for part in (self.vision, self.text, self.region):
            part.validate()
        if self.vision.proj_out_size != self.text.hidden_size:
            raise ValueError(f"vision proj_out_size {self.vision.proj_out_size} != text hidden_size {self.text.hidden_size}")

    @property
    def prefix_len(self) -> int:
        """BOS + one image's tokens: the positions that attend to each other both ways (730)."""
        return 1 + self.vision.tokens_per_image

    @classmethod
    def tiny(cls) -> "MoondreamConfig":
        """The moondream2 layout at test size: 28-px crops of 7-px patches (a 4x4 grid, 16 image
        tokens, margin 1), 2 vision and 2 text layers, small widths, 32 bins per region decoder."""
        return cls(
            vision=MoondreamVisionConfig(crop_size=28, patch_size=7, num_layers=2, hidden_size=32,
                                         intermediate_size=48, num_heads=4, max_crops=4, overlap_margin=1,
                                         proj_inner_size=64, proj_out_size=64),
            text=MoondreamTextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                                     num_heads=4, num_kv_heads=4, rotary_dim=8, max_position_embeddings=256,
                                     name="tiny-moondream"),
            region=MoondreamRegionConfig(coord_feat_dim=16, coord_bins=32, size_feat_dim=24, size_bins=32,
                                         inner_size=96),
        )

    @classmethod
    def from_reference_dict(cls, d: dict, name: str = "moondream2") -> "MoondreamConfig":
        """From the `config` dict of a moondream2 folder's config.json (the public reference's field
        names, sections text/vision/region/tokenizer; an empty dict is the released model)."""
        known = {"text", "vision", "region", "tokenizer"}
        if not isinstance(d, dict) or set(d) - known:
            raise CorruptModelError(f"moondream config: expected sections {sorted(known)}, got {d!r:.200}")
        t, v, r, tok = (d.get(k, {}) or {} for k in ("text", "vision", "region", "tokenizer"))
        try:
            text = _pick(MoondreamTextConfig, t, {"dim": "hidden_size", "ff_dim": "intermediate_size",
                                                  "n_layers": "num_layers", "vocab_size": "vocab_size",
                                                  "max_context": "max_position_embeddings", "n_heads": "num_heads",
                                                  "n_kv_heads": "num_kv_heads"},
                         ignore={"prefix_attn", "group_size"})
            # the reference derives it: a table of dim // (2 * n_heads) dims, i.e. half of each head (32)
            text["rotary_dim"] = text.get("hidden_size", 2048) // (2 * text.get("num_heads", 32))
            vision = _pick(MoondreamVisionConfig, v, {"enc_dim": "hidden_size", "enc_patch_size": "patch_size",
                                                      "enc_n_layers": "num_layers", "enc_ff_dim": "intermediate_size",
                                                      "enc_n_heads": "num_heads", "proj_out_dim": "proj_out_size",
                                                      "crop_size": "crop_size", "in_channels": "in_channels",
                                                      "max_crops": "max_crops", "overlap_margin": "overlap_margin",
                                                      "proj_inner_dim": "proj_inner_size"})
            region = _pick(MoondreamRegionConfig, r, {"coord_feat_dim": "coord_feat_dim", "coord_out_dim": "coord_bins",
                                                      "size_feat_dim": "size_feat_dim", "inner_dim": "inner_size"},
                           ignore={"dim", "group_size", "size_out_dim"})
            if "size_out_dim" in r:  # (width, height) logits: two halves
                region["size_bins"] = int(r["size_out_dim"]) // 2
            if r.get("dim", text.get("hidden_size", 2048)) != text.get("hidden_size", 2048):
                raise ValueError(f"region dim {r['dim']} is not the text width {text.get('hidden_size', 2048)}")
            # the reference's defaults: <|endoftext|> (50256) opens the prompt and ends the answer
            eos = tok.get("eos_id", REFERENCE_EOS)
            templates = tok.get("templates") or {}
            query = templates.get("query") or {}
            skills = {k: _template(templates, k, getattr(cls, f"{k}_template")) for k in ("point", "detect")}
            config = cls(vision=MoondreamVisionConfig(**vision),
                         text=MoondreamTextConfig(**text, bos_token_id=tok.get("bos_id", REFERENCE_EOS),
                                                  eos_token_ids=(eos,), name=name),
                         region=MoondreamRegionConfig(**region),
                         coord_token_id=tok.get("coord_id", 5), size_token_id=tok.get("size_id", 6),
                         query_prefix=tuple(query.get("prefix", cls.query_prefix)),
                         query_suffix=tuple(query.get("suffix", cls.query_suffix)),
                         point_template=skills["point"], detect_template=skills["detect"])
        except (TypeError, ValueError) as exc:
            raise CorruptModelError(f"moondream config: {exc}") from exc
        if any(g is not None for g in (t.get("group_size"), r.get("group_size"))):
            raise CorruptModelError("moondream config: quantised (group_size) checkpoints are not supported")
        return config


def _template(templates: dict, name: str, default):
    """(prefix ids, suffix ids) of a skill's template: absent = the reference's, null = no such skill."""
    if name not in templates:
        return default
    t = templates[name]
    if t is None:
        return None
    if not isinstance(t, dict) or set(t) - {"prefix", "suffix"}:
        raise ValueError(f"tokenizer template {name!r} must be {{prefix, suffix}} ids or null, got {t!r:.100}")
    return tuple(int(i) for i in t.get("prefix", ())), tuple(int(i) for i in t.get("suffix", ()))


def _pick(cls, d: dict, names: dict[str, str], ignore: frozenset | set = frozenset()) -> dict:
    """The reference's fields renamed to ours; an unknown field is an error (it may change the layout)."""
    ours = {f.name for f in fields(cls)}
    unknown = set(d) - set(names) - set(ignore)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}")
    out = {names[k]: v for k, v in d.items() if k in names}
    assert set(out) <= ours
    return out
