"""Differentiable, batched training twins of the reference target, MTP head and DFlash 2 draft."""
