"""Generated stubs of protos/ (`python -m dyngen_client.proto.generate`); do not edit them."""
