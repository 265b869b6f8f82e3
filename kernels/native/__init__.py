"""The native CPU library: C sources (csrc/), their build and typed bindings, and what runs on them alone."""
