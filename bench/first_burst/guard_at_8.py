"""The guard vs plain decoding (verify mode off) at 8 rows in one BatchEngine, in process:
8 short chat prompts, 64 tokens, the guard priced from its measured curves.

    MLX_DFLASH_HOME=/tmp/b8-home MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. python bench/first_burst/guard_at_8.py
"""
import time
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.settings_checks import settings_store
from mlx_dflash.engine.batch import BatchEngine
from mlx_dflash.engine.calibrate import Calibration
from mlx_dflash import DecodeConfig
lm = load_model(None, settings_store())
TOPICS = ["a binary search in Python", "the water cycle", "how a hash map works", "the causes of tides",
          "a stack class in Python", "why the sky is blue", "how TCP opens a connection", "merge sort in C"]
prompts = [lm.tokenizer.apply_chat_template([{"role":"user","content":f"Explain {t} in a few sentences."}], add_generation_prompt=True) for t in TOPICS]
cal = Calibration()
e = BatchEngine(lm.model, lm.tokenizer, lm.drafter, max_batch=16, calibration=cal, defer_costs=True)
e.costs.prepare(8, contexts=()); 
while e.costs.measure_next(): pass
def run(defer, mode="dflash"):
    eng = BatchEngine(lm.model, lm.tokenizer, lm.drafter, max_batch=16, calibration=None if defer else cal, defer_costs=defer)
    for p in prompts: eng.submit(p, DecodeConfig(max_tokens=64, verify_mode=mode))
    t=time.perf_counter(); n=0; last={}
    for u, r in eng.run(): n+=1; last[u]=r.stats
    st = list(last.values())[0]
    return round(n/(time.perf_counter()-t),1), eng.cycles, st.drafted, st.lookup_cycles, st.policy[:90]
for i in range(4):
    print("off", run(True, "off")); print("guard", run(False)); o = cal.prior(lm.model, lm.drafter); print("  carried", o and {k: round(v, 2) for k, v in o.paid.items()})
print(cal.book._entries and [ (t, c.t1, c.c) for t,c in list(cal.book._entries.values())[0][3] if t[1]==8])
