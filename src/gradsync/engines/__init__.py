"""Data-parallel engines: what wraps the model and carries out a sync policy's decisions."""
