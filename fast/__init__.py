"""dflash2.fast: the optimized engine behind ``ft generate``, ``ft serve`` and ``LLM.generate``
(``fast/llm.py``); ``docs/architecture.md`` walks through it.

It may import the reference's shared packages (``formats``, ``tiny``, ``request``), never its
compute (``model``, ``speculative``): tests/test_layout.py holds that line.
"""
