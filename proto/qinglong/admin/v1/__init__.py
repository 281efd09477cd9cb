"""Generated protobuf/gRPC code for qinglong.admin.v1 (scripts/generate_protos.py)."""
