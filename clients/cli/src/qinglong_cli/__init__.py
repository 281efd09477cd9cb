"""qinglong_cli."""
