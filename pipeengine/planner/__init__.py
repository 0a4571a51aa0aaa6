"""Planning before a run: the layer profiler, the partitioner, the planner (tune)."""
