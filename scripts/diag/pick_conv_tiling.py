"""Set fast/kernels/conv_prepare.py's default tiling to the fastest in a bench_draft_kernels.py result (summed over B).

    python3 scripts/diag/pick_conv_tiling.py draft_kernels.json     # from the repo root; edits the file in place
"""
import json,re,sys
r=json.load(open(sys.argv[1]))["rows"]
un={x["B"]:x["us"] for x in r if x["op"]=="conv_prepare" and x["form"].startswith("unfused")}
fu=[x for x in r if x["op"]=="conv_prepare" and x["form"]=="fused"]
key=lambda x:(x["max_block_k"],x["num_warps"],x["groups_per_program"])
tot={}
for x in fu: tot.setdefault(key(x),0.0); tot[key(x)]+=x["us"]
best=min(tot,key=tot.get); print("unfused",un,"best",best,tot[best])
p="fast/kernels/conv_prepare.py"; s=open(p).read()
s=re.sub(r"MAX_BLOCK_K = \d+",f"MAX_BLOCK_K = {best[0]}",s); s=re.sub(r"NUM_WARPS = \d+",f"NUM_WARPS = {best[1]}",s); s=re.sub(r"GROUPS_PER_PROGRAM = \d+",f"GROUPS_PER_PROGRAM = {best[2]}",s)
open(p,"w").write(s)
