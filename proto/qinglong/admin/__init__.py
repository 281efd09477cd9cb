"""Generated protobuf/gRPC code for qinglong.admin (scripts/generate_protos.py)."""
