"""LoRA adapters for the Llama family (Llama, Qwen2): a PEFT folder read and checked, and the delta each
projection adds for the tokens whose row names an adapter (docs/lora.md).

A PEFT LoRA folder holds `adapter_config.json` and `adapter_model.safetensors`, with tensors named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight`: A [r, in], B [out, r].
A projection's output becomes `base(x) + (x @ A^T) @ B^T * scale`, scale = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). `load_peft_adapter` refuses, naming the field, what it would otherwise
compute wrongly (DoRA, biases, patterns, modules it does not compute, shapes that are not the base's).

A step mixes rows of several adapters and of none: each token carries its row's adapter slot
(`LoraInput.slots`, gathered on the device from the row tables' column), and `LoraGroups` sorts the
step's tokens by slot once per forward; each projection then adds the deltas of every adapter
present in the step, its A matrices fused across the projections that share an input (q/k/v,
gate/up). Two implementations of that one sum: on the CPU backend one compiled call per layer and
input group for all adapters (`add_cpu`, sq_lora_add in layer_ops_cpu.c, reading each adapter's
`records`), elsewhere a pair of torch matmuls per adapter present (`add`); tests/test_lora_kernel.py
holds both to a float64 reference. The triton backend (CUDA) reads no count on the host: its adapters
live in a device bank of fixed shape and each token reads its own slot (models/lora_bank.py).
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.errors import LoraAdapterError
from slipstream.models.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# projections that read the same input: their A matrices are stacked into one matmul
INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
DEFAULT_MAX_LORA_RANK = 64


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection a LoRA may target."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(frozen=True, eq=False)
class GroupWeights:
    """One input group of one layer: A of its targets stacked [sum r, in], and each target's B with the
    scale folded in, stored transposed [r, out] (the kernel's expand adds rows of it: vectors along
    the output, no horizontal sum), and its rows of the stacked A product."""

    a: torch.Tensor
    b: tuple[tuple[str, int, int, torch.Tensor], ...]  # (target, first, end, B^T)


@dataclass(frozen=True, eq=False)
class LoraWeights:
    """A loaded adapter: per layer, per input group (INPUT_GROUPS' order), its weights or None."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    alpha: float
    rslora: bool
    targets: tuple[str, ...]
    layers: tuple[tuple[GroupWeights | None, ...], ...]
    # [layers, groups, LORA_REC] int64: each group's weights as sq_lora_add reads them (pointers into
    # `layers`' tensors, which this object keeps alive); None off the CPU
    records: torch.Tensor | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(g.a.numel() * g.a.element_size() + sum(b.numel() * b.element_size() for *_, b in g.b)
                   for layer in self.layers for g in layer if g is not None)


def _refuse(name: str, message: str, field_name: str) -> LoraAdapterError:
    return LoraAdapterError(f"LoRA adapter {name!r}: {message}", param=field_name)


def _read_config(name: str, path: str, max_rank: int) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise _refuse(name, f"{path!r} is not a folder (a PEFT adapter folder holds {CONFIG_FILE} and "
                            f"{WEIGHTS_FILE})", "lora_path")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise _refuse(name, f"{file} is missing", CONFIG_FILE) from None
    except (OSError, ValueError) as e:
        raise _refuse(name, f"{file} is not readable JSON: {e}", CONFIG_FILE) from None
    if not isinstance(cfg, dict):
        raise _refuse(name, f"{file} is not a JSON object", CONFIG_FILE)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, f"peft_type {cfg.get('peft_type')!r} is not supported (only LORA)", "peft_type")
    # what would change the function computed: refused, never ignored
    for key, neutral in (("use_dora", False), ("fan_in_fan_out", False), ("lora_bias", False)):
        if cfg.get(key) not in (None, neutral):
            raise _refuse(name, f"{key}={cfg[key]!r} is not supported", key)
    if cfg.get("bias", "none") != "none":
        raise _refuse(name, f"bias={cfg['bias']!r} is not supported (only 'none')", "bias")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layer_replication", "target_parameters",
                "trainable_token_indices"):
        if cfg.get(key):
            raise _refuse(name, f"{key} is not supported (got {cfg[key]!r})", key)
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _refuse(name, f"r must be a positive integer, got {r!r}", "r")
    if r > max_rank:
        raise _refuse(name, f"r={r} is above max_lora_rank={max_rank}", "r")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _refuse(name, f"lora_alpha must be a number, got {alpha!r}", "lora_alpha")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        lacking = [t for t in targets if t not in TARGETS]
        if lacking:
            raise _refuse(name, f"target_modules {lacking} are not modules this model computes a LoRA for "
                                f"({', '.join(TARGETS)})", "target_modules")
    elif targets is not None and not isinstance(targets, str):  # (a str is a regex: the tensors say what it matched)
        raise _refuse(name, f"target_modules must be a list or a string, got {targets!r}", "target_modules")
    return cfg


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(file):
        also = " (adapter_model.bin is not read: save with safe_serialization)" \
            if os.path.exists(os.path.join(path, "adapter_model.bin")) else ""
        raise _refuse(name, f"{file} is missing{also}", WEIGHTS_FILE)
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad file
        raise _refuse(name, f"{file} is not a readable safetensors file: {type(e).__name__}: {e}",
                      WEIGHTS_FILE) from None


def load_peft_adapter(name: str, path: str, config: ModelConfig, max_rank: int = DEFAULT_MAX_LORA_RANK,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoraWeights:
    """Read and check a PEFT LoRA folder against the base model's config (LoraAdapterError naming the
    field or file otherwise); blocking file I/O, meant for a thread."""
    path = os.fspath(path)
    cfg = _read_config(name, path, max_rank)
    tensors = _read_tensors(name, path)
    shapes = target_shapes(config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _refuse(name, f"tensor {key!r} is not a LoRA A/B weight of a decoder layer's projection "
                                f"(embeddings, lm_head, DoRA magnitudes and biases are not supported)", WEIGHTS_FILE)
        layer, parent, target, ab = int(m[1]), m[2], m[3], m[4]
        if target not in TARGETS or _PARENT[target] != parent:
            raise _refuse(name, f"tensor {key!r}: the model has no module {parent}.{target} to adapt "
                                f"(targets: {', '.join(TARGETS)})", "target_modules")
        if layer >= config.num_layers:
            raise _refuse(name, f"tensor {key!r}: layer {layer} is beyond the model's {config.num_layers}",
                          WEIGHTS_FILE)
        found.setdefault((layer, target), {})[ab] = tensor
    if not found:
        raise _refuse(name, f"{WEIGHTS_FILE} holds no LoRA weights", WEIGHTS_FILE)
    alpha, rslora = float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora", False))
    r_cfg = cfg["r"]
    scale = alpha / math.sqrt(r_cfg) if rslora else alpha / r_cfg
    per_layer: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    rank = 0
    for (layer, target), ab in sorted(found.items()):
        where = f"layers.{layer}.{_PARENT[target]}.{target}"
        if set(ab) != {"A", "B"}:
            raise _refuse(name, f"{where} has lora_{''.join(ab)} without its pair", WEIGHTS_FILE)
        a, b = ab["A"], ab["B"]
        n_in, n_out = shapes[target]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
            raise _refuse(name, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
                                f"projection [{n_out}, {n_in}] (expected A [r, {n_in}], B [{n_out}, r])", "shape")
        r = a.shape[0]
        if r != r_cfg:
            raise _refuse(name, f"{where} has rank {r}, the config's r is {r_cfg}", "r")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _refuse(name, f"{where} holds non-finite values", WEIGHTS_FILE)
        rank = max(rank, r)
        if config.rotary_dim is not None and target in ("q_proj", "k_proj"):  # (the base rows' partial-rotary order)
            from slipstream.models.kernels.rotary import partial_rotary_order, reorder_heads

            heads = config.num_heads if target == "q_proj" else config.num_kv_heads
            b = reorder_heads(b, heads, partial_rotary_order(config.head_dim, config.rotary_dim))
        per_layer[layer][target] = (a.to(dtype=torch.float32), b.to(dtype=torch.float32) * scale)
    layers = []
    for entries in per_layer:
        groups: list[GroupWeights | None] = []
        for group in INPUT_GROUPS:
            present = [t for t in group if t in entries]
            if not present:
                groups.append(None)
                continue
            at, bs = 0, []
            for t in present:
                r = entries[t][0].shape[0]
                bs.append((t, at, at + r, entries[t][1].T.to(device=device, dtype=dtype).contiguous()))
                at += r
            a_cat = torch.cat([entries[t][0] for t in present]).to(device=device, dtype=dtype).contiguous()
            groups.append(GroupWeights(a_cat, tuple(bs)))
        layers.append(tuple(groups))
    targets = tuple(t for t in TARGETS if any(t in e for e in per_layer))
    records = _records(layers) if torch.device(device).type == "cpu" and dtype == torch.float32 else None
    return LoraWeights(name, path, rank, alpha, rslora, targets, tuple(layers), records)


LORA_REC = 15  # longs per (layer, group) record of sq_lora_add: A, r_total, n_b, then (B^T, lo, hi, j) x 3


def _records(layers: list[tuple[GroupWeights | None, ...]]) -> torch.Tensor:
    rec = torch.zeros(len(layers), len(INPUT_GROUPS), LORA_REC, dtype=torch.int64)
    for i, groups in enumerate(layers):
        for k, w in enumerate(groups):
            if w is None:
                continue  # (a null A: not adapted)
            row = [w.a.data_ptr(), w.a.shape[0], len(w.b)]
            for target, lo, hi, b in w.b:
                row += [b.data_ptr(), lo, hi, INPUT_GROUPS[k].index(target)]
            rec[i, k, :len(row)] = torch.tensor(row, dtype=torch.int64)
    return rec


@dataclass(eq=False)
class LoraInput:
    """What a forward batch carries for LoRA: each token's adapter slot (0: the base model) and the
    adapters by slot (index 0 is None). The groups are built once per forward, on first use."""

    slots: torch.Tensor  # [T] int64
    adapters: tuple[LoraWeights | None, ...]
    # the triton backend's device buffers of every slot (a models/lora_bank.LoraBank: that module imports
    # this one), else None
    bank: Any = None
    _groups: "LoraGroups | None" = field(default=None, repr=False)

    def groups(self) -> "LoraGroups":
        if self._groups is None:
            self._groups = LoraGroups(self.slots, self.adapters)
        return self._groups


class LoraGroups:
    """The step's tokens sorted by adapter slot: per adapter present, its token indices (None: every
    token of the step is that adapter's). One bincount and one argsort per forward; the host reads
    only the counts per slot, never a per-row value."""

    def __init__(self, slots: torch.Tensor, adapters: tuple[LoraWeights | None, ...]):
        counts = torch.bincount(slots, minlength=len(adapters)).tolist()
        total = slots.shape[0]
        self.groups: list[tuple[LoraWeights, torch.Tensor | None]] = []
        self._slots = slots
        self._native: tuple | None = None
        order = None
        at = counts[0]
        for s in range(1, len(adapters)):
            n = counts[s]
            if n:
                adapter = adapters[s]
                if adapter is None:  # an emptied slot: only a finished request's row (its tokens are dropped)
                    pass
                elif n == total:
                    self.groups.append((adapter, None))
                else:
                    if order is None:
                        order = torch.argsort(slots, stable=True)
                    self.groups.append((adapter, order[at:at + n]))
            at += n
        self._order = order
        self._compiled = all(adapter.records is not None for adapter, _ in self.groups)  # else add's matmuls

    def __bool__(self) -> bool:
        return bool(self.groups)

    def add(self, layer: int, group: int, x: torch.Tensor, outs: dict[str, torch.Tensor]) -> None:
        """outs[target] += the LoRA delta of the tokens of each adapter, for the projections of input
        group `group` (INPUT_GROUPS) of `layer`, whose input is `x` [T, in]; outs' tensors are [T, out]
        (views allowed)."""
        for adapter, rows in self.groups:
            w = adapter.layers[layer][group]
            if w is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            mid = xs @ w.a.T
            for target, lo, hi, b in w.b:
                y = outs[target]
                d = mid[:, lo:hi] @ b
                if rows is None:
                    y += d
                else:
                    y.index_add_(0, rows, d)

    def _native_tables(self) -> tuple:
        """(sorted tokens, segment offsets, the present adapters' records, scratch, its row width), built
        on the first add_cpu of a forward."""
        if self._native is None:
            tokens, seg, recs = [], [0], []
            order = self._order if self._order is not None else torch.arange(self._slots.shape[0])
            for adapter, rows in self.groups:
                assert adapter.records is not None  # (add_cpu takes add's path otherwise)
                tokens.append(order if rows is None else rows)
                seg.append(seg[-1] + tokens[-1].shape[0])
                recs.append(adapter.records)
            rmax = max(int(r[:, :, 1].max()) for r in recs)
            self._native = (torch.cat(tokens).to(torch.int64).contiguous(), torch.tensor(seg, dtype=torch.int64),
                            torch.stack(recs).contiguous(), torch.empty(seg[-1], max(rmax, 1)), max(rmax, 1))
        return self._native

    def native_step(self):
        """The step's adapters as the one-call C stack reads them (cpu_kernels.LoraStep; kept alive by this
        object), or None where an adapter has no records (add's matmuls then, on the per-layer path)."""
        if not self._compiled:
            return None
        from slipstream.models.kernels.cpu_kernels import LoraStep

        tokens, seg, recs, mid, rmax = self._native_tables()
        return LoraStep(tokens.data_ptr(), seg.data_ptr(), seg.shape[0] - 1, recs.data_ptr(), recs.stride(0),
                        recs.stride(1), mid.data_ptr(), rmax)

    def add_cpu(self, lib, layer: int, group: int, x: torch.Tensor, outs: dict[str, torch.Tensor]) -> None:
        """add's sum in one compiled call for every adapter of the step (the CPU backend; float32 rows
        whose elements are contiguous); add's matmuls where an adapter has no records."""
        from slipstream.models.kernels.cpu_kernels import check_rc

        if not self.groups:
            return None
        if not self._compiled:
            return self.add(layer, group, x, outs)

        tokens, seg, recs, mid, rmax = self._native_tables()
        names = INPUT_GROUPS[group]
        views = [outs[n] for n in names]
        assert x.stride(1) == 1 and all(v.stride(1) == 1 for v in views)
        ptrs = (ctypes.c_void_p * 3)(*[v.data_ptr() for v in views], *[None] * (3 - len(views)))
        lds = (ctypes.c_int64 * 3)(*[v.stride(0) for v in views], *[0] * (3 - len(views)))
        nouts = (ctypes.c_int64 * 3)(*[v.shape[1] for v in views], *[0] * (3 - len(views)))
        rec_stride = recs.stride(0)
        rec = recs.data_ptr() + (layer * recs.stride(1) + group * recs.stride(2)) * recs.element_size()
        check_rc(lib.sq_lora_add(x.data_ptr(), x.stride(0), x.shape[1], tokens.data_ptr(), seg.data_ptr(),
                                 seg.shape[0] - 1, rec, rec_stride, mid.data_ptr(), rmax, ptrs, lds, nouts),
                 "sq_lora_add: an adapter record does not fit its group")


def lora_groups(batch) -> LoraGroups | None:
    """The batch's LoRA groups, or None when no token of it has an adapter."""
    inp = batch.lora
    if inp is None:
        return None
    groups = inp.groups()
    return groups if groups else None
