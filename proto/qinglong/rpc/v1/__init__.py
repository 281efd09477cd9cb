"""Generated protobuf/gRPC code for qinglong.rpc.v1 (scripts/generate_protos.py)."""
