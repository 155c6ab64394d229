"""Plain helpers of the test suite (no fixtures: those are in ``tests/conftest.py``).

``models``: tiny random-weight checkpoints and their constants; ``compare``: prompts and
reference checks against transformers; ``plain_scheduling``: a scheduler driven with fake
tokens (no torch); ``stress_driver``: the randomized traffic loop of the engine stress tests."""
