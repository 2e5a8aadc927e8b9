"""Where the seeded row of r1-736 stood at its 9th sample: its top-p boundary and the draw.
Reads the pickle written by capture_sampling.py (the row's raw logits and sampling tables)."""
import pickle
import sys

import torch

from slipstream.runtime.sampler import _filter_top_k_top_p, row_keys, uniforms

caps = pickle.load(open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pdbg/cap.pkl", "rb"))
for step, _t, _row, raw, ints, fl, tok, _needs in caps[:9]:
    top_k, seed, oi = ints[0:1], ints[1:2], ints[2:3]
    temp, top_p = fl[0:1], fl[1:2]
    x = raw[None] / temp[:, None]
    kept = _filter_top_k_top_p(x, top_k, top_p)
    g = -(-uniforms(row_keys(seed, oi), raw.shape[-1]).log()).log()
    s = (kept + g)[0]
    v, i = s.topk(2)
    print(f"step {step} output_index {int(oi)} sampled {tok} best {i.tolist()} margin {float(v[0] - v[1]):.6f} "
          f"kept {int(torch.isfinite(kept).sum())}")
step, _t, _row, raw, ints, fl, tok, _needs = caps[8]
x = raw[None] / fl[0:1][:, None]
sx, order = torch.sort(x, -1, descending=True)
probs = sx[:, :int(ints[0])].softmax(-1)
cum = probs.cumsum(-1) - probs
o = order[0].tolist()
r = o.index(157)
print(f"token 157: rank {r}, mass before it {float(cum[0, r]):.10f}, top_p {float(fl[1]):.10f} -> "
      f"{'dropped' if float(cum[0, r]) >= float(fl[1]) else 'kept'}; score 157 {float(x[0, 157] + (-(-uniforms(row_keys(ints[1:2], ints[2:3]), raw.shape[-1]).log()).log())[0, 157]):.4f}")
