import json, time, sys, torch
from jex.engine_spec import EngineSpec
from jex.tasks.capture.engine_pool import get_engine
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

seqs = json.load(open("/tmp/exp/seqs.json"))
N = int(sys.argv[1]) if len(sys.argv) > 1 else 32
PACK = int(sys.argv[2]) if len(sys.argv) > 2 else 8
seqs = seqs[:N]
eng = get_engine(EngineSpec())
model = eng.model
print("threads", torch.get_num_threads(), "attn", model.config._attn_implementation)

def per_row():
    out = []
    for s in seqs:
        lp = eng._forward_logprobs([s], last_only=True)[0]
        out.append(lp)
    return out

SEG = {}
def seg_attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    outs = []
    for a, b in SEG["bounds"]:
        o, _ = sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                      dropout=0.0, scaling=scaling, is_causal=True)
        outs.append(o)
    return torch.cat(outs, dim=1), None

AttentionInterface.register("jex_segments", seg_attn)
AttentionMaskInterface.register("jex_segments", lambda *a, **k: None)

def packed():
    out = []
    model.config._attn_implementation = "jex_segments"
    try:
        for start in range(0, len(seqs), PACK):
            group = seqs[start:start + PACK]
            ids = torch.tensor([t for s in group for t in s]).unsqueeze(0)
            pos = torch.tensor([i for s in group for i in range(len(s))]).unsqueeze(0)
            bounds, a = [], 0
            for s in group:
                bounds.append((a, a + len(s))); a += len(s)
            SEG["bounds"] = bounds
            with torch.inference_mode():
                h = model.model(input_ids=ids, position_ids=pos).last_hidden_state
                last = h[0, [b - 1 for _, b in bounds]]
                logits = torch.stack([model.lm_head(last[i:i+1].unsqueeze(0))[0] for i in range(len(bounds))]).double()
            lp = torch.log_softmax(logits[:, -1], dim=-1)
            out.extend(lp)
    finally:
        model.config._attn_implementation = "sdpa"
    return out

for rnd in range(1):
    t0 = time.perf_counter(); a = per_row(); t1 = time.perf_counter(); b = packed(); t2 = time.perf_counter()
    same = sum(bool(torch.equal(x, y)) for x, y in zip(a, b))
    maxd = max(float((x - y).abs().max()) for x, y in zip(a, b))
    print(f"round {rnd}: per-row {t1-t0:.2f}s packed{PACK} {t2-t1:.2f}s ratio {(t1-t0)/(t2-t1):.2f} identical {same}/{len(a)} maxdiff {maxd:.3g}")
