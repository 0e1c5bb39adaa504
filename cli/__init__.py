"""The ``ft`` command line (``dflash2.cli``), above the packages it runs: ``fast`` (generate, serve), the
``reference`` runner (``generate --engine reference``), ``bench`` and ``train``. None of those imports it.

``ft generate``  decode one prompt (``generate.py``);
``ft serve``     an OpenAI-compatible server on the fast engine (``serve.py`` -> ``fast/serve/``);
``ft make-tiny`` write a tiny random checkpoint in real HF format (tests, demos);
``ft bench``     benchmarks at real shapes (``bench/cli.py``); ``ft train`` the training recipe (``train/cli.py``).

User errors (bad paths, configs, checkpoints, sampling parameters, devices) print one line to stderr and exit
with status 2; anything else is a bug and keeps its traceback. ``python -m dflash2.cli`` is ``ft``.
"""
