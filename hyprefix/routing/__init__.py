"""Routing requests between engine replicas by what each one has cached (no torch)."""
