"""Speculative decoding in the fast engine: batched proposers (DFlash 2, MTP) and the batched verifier."""
