"""qinglong_ingress."""
