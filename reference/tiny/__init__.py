"""Tiny random checkpoints written in the real formats (HF safetensors, tokenizer.json, chat
template), so tests and the demo exercise the same loading path a released checkpoint takes."""
