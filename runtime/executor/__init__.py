"""Runs the batches the scheduler hands over: the model runner, the batch contract, CUDA graphs, compiled CPU
decode (its graphs' cache and background builder), the serving model, the draft model and tensor-parallel rank
control. Scheduler process (and TP followers)."""
