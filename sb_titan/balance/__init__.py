"""Load balancing: the cost model, SAB (sparsity-aware batching), DST (dynamic
sparsity tuning), and the Balancer that runs them as one control loop (balancer.py)."""
