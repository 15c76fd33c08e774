import time, json, sys, torch, subprocess, ctypes
from pathlib import Path
import infercore.ops.moe.cpu_native as cn
from infercore.ops.moe.cpu_native import moe_experts_bf16
libs={}
for name in sys.argv[2].split(","):
    cn._SRC=Path(f"/tmp/p/{name}.c"); cn._tried=False; cn._lib=None
    libs[name]=cn._build()
cn._tried=True
E,k,H,I=128,8,2048,768
torch.manual_seed(0)
gu=torch.randn(E,2*I,H,dtype=torch.bfloat16)*0.02; dn=torch.randn(E,H,I,dtype=torch.bfloat16)*0.02
g=torch.Generator().manual_seed(1)
def t(fn,reps=3):
    b=1e9
    for _ in range(reps):
        s=time.perf_counter(); fn(); b=min(b,time.perf_counter()-s)
    return b*1e3
Ts=[int(a) for a in sys.argv[1].split(",")]
with torch.inference_mode():
  for T in Ts:
    x=torch.randn(T,H,dtype=torch.bfloat16,generator=g)
    ids=torch.stack([torch.randperm(E,generator=g)[:k] for _ in range(T)]); w=torch.softmax(torch.randn(T,k,generator=g),-1)
    r={n:[] for n in libs}; outs={}
    for _ in range(3):
        for n,l in libs.items():
            cn._lib=l
            outs[n]=moe_experts_bf16(x,gu,dn,w,ids)
            r[n].append(t(lambda: moe_experts_bf16(x,gu,dn,w,ids), 5 if T<=16 else 2))
    print(T,{n:round(min(v),2) for n,v in r.items()}, all(torch.equal(outs["old"],o) for o in outs.values()),flush=True)
