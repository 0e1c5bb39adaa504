"""cProfile of one CPU generation with the bundled pair: python scripts/diag/cpu_step_profile.py dflash 3 1.0 (algorithm, k or 0, temperature)."""
import sys, cProfile, pstats
from dflash2.fast.llm import LLM, SamplingParams
alg, k, temp = sys.argv[1], int(sys.argv[2]) or None, float(sys.argv[3])
llm = LLM(None, device="cpu", speculative_algorithm=alg, speculative_num_steps=k, max_running_req=1)
prompt = "def parse_args(argv):\n    \"\"\"Parse the command line.\"\"\"\n    parser = argparse.ArgumentParser("
sp = SamplingParams(max_tokens=96, temperature=temp, top_p=0.95 if temp > 0 else 1.0, seed=1, ignore_eos=True)
llm.generate([prompt], sp)
pr = cProfile.Profile(); pr.enable(); llm.generate([prompt], sp); pr.disable()
st = pstats.Stats(pr); st.sort_stats("cumulative").print_stats(60)
