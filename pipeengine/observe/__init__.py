"""Seeing inside a step: tracing (spans on one clock) and the memory ledger."""
