"""Batched, token-major model forwards of the fast engine (target, MTP head, DFlash draft)."""
