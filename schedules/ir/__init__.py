"""The instruction set, a schedule (placement and per-rank streams, its text form) and its dataflow."""
