"""dflash2.fast: the optimized engine behind ``ft serve`` and ``LLM.generate``.

It may import the reference's config, checkpoint and validation modules, never its compute.
"""
