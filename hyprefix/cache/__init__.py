"""Cache bookkeeping: pure Python, imports no torch."""
