"""Load balancing: the cost model, SAB (sparsity-aware batching) and DST (dynamic
sparsity tuning), and the rules that cut a step into work units."""
