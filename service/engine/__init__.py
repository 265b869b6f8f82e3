"""The engine process: its entry point, the loop that serves the pipe, the engine build, the proto codec."""
