"""Linear kinds: the seam (make_linear), each kind's implementation, the load-time autotune."""
