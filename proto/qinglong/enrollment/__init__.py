"""Generated protobuf/gRPC code for qinglong.enrollment (scripts/generate_protos.py)."""
