"""Structured outputs: what a request constrains its output to (``spec.py``, plain data) and
the grammar engine that holds a sampler to it (``grammar.py``, llguidance)."""
