"""Step 4 of a GRPO step and the run around it: the Lightning module, the log-prob passes (with shared
prompts), and the reference model."""
