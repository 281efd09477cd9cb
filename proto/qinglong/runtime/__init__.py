"""Generated protobuf/gRPC code for qinglong.runtime (scripts/generate_protos.py)."""
