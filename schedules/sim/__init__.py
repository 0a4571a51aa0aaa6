"""The simulator (time and memory), the Timeline it and the engine's tracing produce, and its plots and traces."""
