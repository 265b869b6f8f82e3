"""Structured output: the response format (torch-free) and its compiled grammar constraints."""
