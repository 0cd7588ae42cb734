"""Generated moe.v1 stubs (generate_stubs.py)."""
