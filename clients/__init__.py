"""Clients of dyngen: the `dyngen` command line, and (later) the Python gRPC client."""
