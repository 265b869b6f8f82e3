"""Benchmarks through a running `dyngen serve`: ghz load tests, W4, the soak, scale-out behind HAProxy, an idle server's cost."""
