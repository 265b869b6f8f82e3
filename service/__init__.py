"""The gRPC front end (grpc.aio) that feeds the engine process."""
