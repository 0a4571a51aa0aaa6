"""Construction: from a model, a loss and an EngineConfig, what one rank runs."""
