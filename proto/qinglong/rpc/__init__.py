"""Generated protobuf/gRPC code for qinglong.rpc (scripts/generate_protos.py)."""
