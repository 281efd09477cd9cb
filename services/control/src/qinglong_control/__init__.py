"""qinglong_control."""
