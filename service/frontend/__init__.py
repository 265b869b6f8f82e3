"""The front-end process: gRPC servicer, auth and limits, tokenizing, the engine client. Imports no torch."""
