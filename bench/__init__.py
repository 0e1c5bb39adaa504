"""dflash2.bench: ``ft bench`` (bench/run.py: end-to-end decoding and per-step costs; bench/floors.py: the
floors they are set beside; bench/report.py: JSON, Markdown, plot) and the recorded results
(bench/results/<date>-<gpu>/). bench/shapes/ holds real-shape configs for ``--load-format dummy``."""
