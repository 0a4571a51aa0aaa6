"""Running a step: the executor, its mailbox, stage workers, the split backward, gradient synchronisation."""
