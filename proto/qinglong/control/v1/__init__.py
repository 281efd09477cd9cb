"""Generated protobuf/gRPC code for qinglong.control.v1 (scripts/generate_protos.py)."""
