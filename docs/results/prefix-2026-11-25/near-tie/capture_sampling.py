import sys, runpy, atexit, pickle
sys.argv = ["tools/soak/soak.py"] + sys.argv[1:]
import torch
from slipstream.scheduler import engine_loop
from slipstream.runtime import sampling_launch
T = "r1-736"; TGT = {}; CAP = []
_launch = engine_loop.EngineLoop.launch
def launch(self, step):
    if self.depth == 2:
        seqs = list(step.decode) + [q for w, q in zip(step.chunks, step.chunk_seqs) if w.sample]
        for i, s in enumerate(seqs):
            if s.request_id == T:
                TGT[self.num_steps] = (i, s.row, len(s.output_ids), s.pending_samples, s.num_scheduled)
    return _launch(self, step)
engine_loop.EngineLoop.launch = launch
_sg = sampling_launch.SamplingLauncher._sample_group
def sg(self, slot, sample_rows, g, k, needs, masked):
    t = TGT.get(slot.step_id)
    if t is not None:
        idx = slot.group_dev[g, :k].tolist()
        if t[0] in idx:
            j = idx.index(t[0])
            raw = slot.logits[t[0]].clone()
            row = int(sample_rows[t[0]])
            ints = self.rows.sampling.ints[:, row].clone(); fl = self.rows.sampling.floats[:, row].clone()
            _sg(self, slot, sample_rows, g, k, needs, masked)
            CAP.append((slot.step_id, t, row, raw, ints, fl, int(slot.sampled[t[0]]), needs))
            return
    return _sg(self, slot, sample_rows, g, k, needs, masked)
sampling_launch.SamplingLauncher._sample_group = sg
def dump():
    pickle.dump(CAP, open("/tmp/pdbg/cap.pkl", "wb")); print("CAP", len(CAP))
atexit.register(dump)
runpy.run_path("tools/soak/soak.py", run_name="__main__")
