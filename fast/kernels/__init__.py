"""The compute ops of the fast engine, each a torch twin and its Triton form side by side, grouped by family:
``attention/``, ``gdn/``, ``moe/``, ``dense/``, ``sampling/``, ``draft/``, and ``common/`` (the one dispatcher,
``common/dispatch.KernelOp``, PDL, tickets, the registry of twins). Nothing here imports the rest of ``fast/``.
"""
