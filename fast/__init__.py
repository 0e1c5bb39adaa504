"""dflash2.fast: the optimized engine behind ``ft generate`` and ``LLM.generate``
(``fast/llm.py``); ``docs/architecture.md`` walks through it.

It may import the reference's config, checkpoint and validation modules, never its compute.
"""
