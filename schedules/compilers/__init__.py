"""Compilers: one file per schedule family, each emitting the compute order only; registry.py names them.

Adding a schedule is one file here and one register(...) line in registry.py.
"""
