"""qinglong_worker."""
