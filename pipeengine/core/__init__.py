"""What everything uses: the config, the grid, boundary specs, stage bounds, tied weights."""
