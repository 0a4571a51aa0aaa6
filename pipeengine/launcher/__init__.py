"""Starting ranks: as processes (or under torchrun) or as threads; and which rank caused a failure."""
