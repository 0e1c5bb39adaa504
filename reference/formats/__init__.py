"""Formats both engines share: config.json parsing and validation, checkpoint loading (target and
DFlash 2 draft), the tokenizer and chat template, and the user-facing errors. No model compute."""
