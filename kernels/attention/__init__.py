"""Attention backends behind one seam (backend.py): torch, native, Triton; the KV layer view."""
