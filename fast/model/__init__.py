"""Batched, token-major model forwards of the fast engine (target, MTP head, DFlash draft).

``batch`` the step contract (ForwardBatch); ``pools`` the caches (paged K/V, GDN slots, verify
scratch, ``commit_verify``); ``step`` per-step metadata shared by every layer; ``ops`` the hook
where GPU kernels replace the torch forms; ``params`` shape-checked canonical weights; one module
per concept twinned with the reference (``norm``, ``rope``, ``attention``, ``gdn``, ``mlp``,
``moe``, ``layer``); ``target`` and ``mtp`` the models.
"""
