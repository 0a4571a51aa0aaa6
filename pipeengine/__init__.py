"""pipeengine: the torch runtime that executes `schedules` across ranks."""

__all__: list[str] = []
