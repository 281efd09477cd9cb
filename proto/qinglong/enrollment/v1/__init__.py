"""Generated protobuf/gRPC code for qinglong.enrollment.v1 (scripts/generate_protos.py)."""
