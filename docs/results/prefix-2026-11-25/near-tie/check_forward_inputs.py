import sys, runpy, atexit
sys.argv = ["tools/soak/soak.py"] + sys.argv[1:]
import torch
from slipstream.scheduler import engine_loop
from slipstream.runtime import row_tables, model_runner
REC = []; BAD = []; SEQS = {}; CUR = {}
_pack = engine_loop.EngineLoop._pack
def pack(self, step):
    p = _pack(self, step)
    if self.depth == 2:
        p._d2 = (self.num_steps, [s.request_id for s in step.decode], [s.num_scheduled for s in step.decode],
                 [(s.request_id, s.row, list(s.pages)) for s in step.seqs])
        for s in step.seqs: SEQS[s.request_id] = s
    return p
engine_loop.EngineLoop._pack = pack
_apply = row_tables.RowTables.apply
def apply(self, u, packed):
    _apply(self, u, packed)
    info = getattr(packed, "_d2", None)
    CUR["info"] = info
    if info:
        for rid, row, pages in info[3]:
            if pages:
                dev = self.pages[row, :len(pages)].tolist()
                if dev != pages: BAD.append(("pages", info[0], rid, row, pages, dev))
row_tables.RowTables.apply = apply
_ff = model_runner.ModelRunner.forward_from
def ff(self, t, host_attention=False):
    info = CUR.pop("info", None)
    if info is not None and not isinstance(t, model_runner.StaticStepTensors):
        dec = t.decode_rows
        ids = self.rows.last_token[dec].tolist(); pos = self.rows.pos[dec].tolist()
        n = len(info[1])
        REC.append((info[0], info[1], ids[:n], pos[:n]))
        if pos[:n] != info[2]: BAD.append(("pos", info[0], info[1], info[2], pos[:n]))
    return _ff(self, t, host_attention)
model_runner.ModelRunner.forward_from = ff
def dump():
    print("BAD", len(BAD))
    for b in BAD[:30]: print(b)
    nbad = 0
    for step, rids, ids, pos in REC:
        for rid, tok, p in zip(rids, ids, pos):
            s = SEQS[rid]
            known = list(s.prompt_ids) + list(s.output_ids)
            if p < len(known) and known[p] != tok:
                nbad += 1
                if nbad < 30: print("TOKEN", step, rid, p, tok, known[p], s.finish_reason)
    print("TOKEN_BAD", nbad)
atexit.register(dump)
runpy.run_path("tools/soak/soak.py", run_name="__main__")
