"""Print probe_mma_variants rows (JSON lines on stdin) one short line each (device-run logs)."""
import json
import sys

for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line.strip()[:300])
        continue
    st = json.dumps(r.get("stamps", ""))[:420]
    print(r["case"][:4], r["m"], r["defines"] or "-", f"{r['stages']}:{r['ctas']}:{r['ksplit']}",
          f"err {r.get('rel_err', -1):.5f} us {r.get('us', -1):.2f} x {r.get('x_bf16', -1):.3f}",
          f"bf16 {r.get('bf16_us', -1):.2f} triton {r.get('triton_us') or -1:.2f}",
          r.get("error", ""), st if st != '""' else "")
