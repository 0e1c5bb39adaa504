"""The engine: memory pools, scheduler, model runner, sampler, offline API plumbing."""
