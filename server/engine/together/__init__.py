"""Several LoRA sessions on one shared base, computed in one pass (``run_together``)."""
