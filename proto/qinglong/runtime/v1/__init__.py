"""Generated protobuf/gRPC code for qinglong.runtime.v1 (scripts/generate_protos.py)."""
