"""The files of a run: its directory, checkpoints that resume exactly, preemption, callbacks, the
completions table, and the exported model."""
