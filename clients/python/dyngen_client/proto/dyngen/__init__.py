"""dyngen.v1 stubs (generated)."""
