"""Capture the fast pass's token sequences for the embedded sample bundle (all rows) -> /tmp/exp/seqs.json"""
import json, glob, time
from jex.engine_spec import EngineSpec
from jex.tasks.store import LocalStore
from jex.tasks.capture import golden
from jex.tasks.records import BundleSummary
import jex.engine.hf as hf
seen = []
orig = hf.HFEngine._forward_logprobs
def spy(self, seqs, last_only, keep=None):
    seen.extend(seqs); return [None]*len(seqs) if False else orig(self, seqs[:0], last_only, keep) + [self.torch.zeros(49152, dtype=self.torch.float64)]*len(seqs)
hf.HFEngine._forward_logprobs = spy
b = BundleSummary.model_validate_json(open(glob.glob("/tmp/p1/store/bundle/*/_SUCCESS.json")[0]).read())
golden.golden_readout(b, EngineSpec(), LocalStore("/tmp/p1/store"), 360)
json.dump(seen, open("/tmp/exp/seqs.json", "w"))
import statistics
L=[len(s) for s in seen]; print(len(L), min(L), statistics.mean(L), max(L))
