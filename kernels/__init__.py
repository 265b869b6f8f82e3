"""Attention and friends behind one typed dispatch (torch CPU path; Triton on CUDA)."""
