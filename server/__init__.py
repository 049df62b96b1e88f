"""trainwire's server side: the training engine, its checkpoints, the journal and the servicer."""
