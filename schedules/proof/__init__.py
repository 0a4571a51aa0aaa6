"""What is proved before anything runs: each instruction once and in order, matched messages, no deadlock."""
