"""The engine's captured steps: CUDA graphs of decode, verify and whole speculative steps (``graph_step.py``), of
short prefill steps (``prefill_graphs.py``), their static buffers and keys (``step_buffers.py``) and the proposal
a steady step launches ahead (``propose_ahead.py``)."""
