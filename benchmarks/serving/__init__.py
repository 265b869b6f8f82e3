"""`python -m benchmarks serving`: served goodput on a traffic trace, dyngen beside the peers' own servers."""
