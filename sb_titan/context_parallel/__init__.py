"""Context parallelism under sparse attention: each row's query blocks are split over a
CP group by predicted sparse cost, K/V are all-gathered, and every rank attends its own
query blocks against the kept key blocks wherever they live (docs/context_parallel.md)."""
