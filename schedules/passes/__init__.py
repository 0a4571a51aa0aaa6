"""Passes over a schedule: lowering (communication), gradient synchronisation, forward-only."""
