import time, sys, torch
from pathlib import Path
import infercore.ops.moe.cpu_native as cn
libs={}
for name in sys.argv[1].split(","):
    cn._SRC=Path(f"/tmp/p/{name}.c"); libs[name]=cn._build()
cn._tried=True
for N,K,reps in [(64,2048,3000),(4096,4096,20),(32768,2048,5)]:
  w=torch.randn(N,K,dtype=torch.bfloat16)
  for M in [1,4]:
    x=torch.randn(M,K,dtype=torch.bfloat16)
    res={}
    for _ in range(2):
      for n,l in libs.items():
        cn._lib=l
        cn.linear_bf16(x,w)
        s=time.perf_counter()
        for _ in range(reps): cn.linear_bf16(x,w)
        dt=(time.perf_counter()-s)/reps
        res[n]=min(res.get(n,1e9),dt)
    print(N,K,M,{n:f"{v*1e6:.1f}us {N*K*2/v/1e9:.1f}GB/s" for n,v in res.items()},flush=True)
