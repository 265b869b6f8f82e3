"""What becomes of a sampled token: intake, the text stream (stops, banned strings), healing, loops."""
